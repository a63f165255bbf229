from contextlib import nullcontext

import pytest
import torch
from torch.nn import functional as F

from selfspec import projection
from selfspec.projection import (LAYOUTS, MAX_LAYER_ROWS, MAX_TUNED_ROWS, ROW_BUCKETS, FewRowLinears, Projection, candidate_layouts,
                                 few_row_linears, row_bucket, tuning_rows)


@pytest.fixture(autouse=True)
def fresh_table(monkeypatch):
    """Each test starts with no layout timed (the table is process-wide)."""
    monkeypatch.setattr(projection, "TABLE", {})
    monkeypatch.setattr(projection, "CHOICE", {})


@pytest.mark.parametrize("name,rows", [(n, r) for r in (1, 2, 3, 4, 5, 8, 9) for n in candidate_layouts(r)])
def test_every_layout_computes_the_same_product(name, rows):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(300, 16, generator=g), torch.randn(rows, 16, generator=g)
    out = LAYOUTS[name](x, w)
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_candidates_and_row_buckets():
    packed = ["packed"] if projection.packing_works(torch.float32) else []
    assert candidate_layouts(1) == ["linear", "weight-major", "weight-major-pad2", *packed]
    assert candidate_layouts(3) == candidate_layouts(8) == ["linear", "weight-major", "weight-major-pairs", *packed]
    assert candidate_layouts(9) == ["linear", "weight-major", *packed]
    assert [row_bucket(r) for r in (1, MAX_TUNED_ROWS, MAX_TUNED_ROWS + 1, ROW_BUCKETS[-1])] == \
        [1, MAX_TUNED_ROWS, ROW_BUCKETS[0], ROW_BUCKETS[-1]]
    assert row_bucket(ROW_BUCKETS[-1] + 1) is None
    assert tuning_rows(3) == [1, 2, 3]
    assert tuning_rows(30) == list(range(1, MAX_TUNED_ROWS + 1)) + [24, 32]


def test_tuned_projection_matches_linear_and_times_each_row_bucket_once_per_shape():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 16, 64, generator=g)
    b = torch.randn(w.shape[0], generator=g)
    proj = Projection(w, b)
    assert proj.autotune
    for shape in [(1, 64), (1, 3, 64), (4, 64), (20, 64)]:
        x = torch.randn(*shape, generator=g)
        out = proj(x)
        assert out.shape == (*shape[:-1], w.shape[0])
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    # One timing per row bucket, every candidate layout measured: 20 rows stand for 17..24.
    assert sorted(proj.choices()) == [1, 3, 4, 24]
    timings = {k[3]: t for k, t in projection.TABLE.items()}
    assert set(timings[1]) == set(candidate_layouts(1)) >= {"linear", "weight-major", "weight-major-pad2"}
    assert set(timings[3]) == set(timings[4]) == set(candidate_layouts(3)) >= {"linear", "weight-major", "weight-major-pairs"}
    assert all(proj.choices()[r] == min(t, key=t.get) for r, t in timings.items())
    # Seen buckets are not timed again, also by another projection of the same shape.
    before = dict(projection.TABLE)
    proj(torch.randn(3, 64, generator=g))
    proj(torch.randn(22, 64, generator=g))
    Projection(torch.randn(1 << 16, 64, generator=g))(torch.randn(4, 64, generator=g))
    assert projection.TABLE == before
    # tune() times the rest up front; beyond the last bucket a product is F.linear, never timed.
    proj.tune(32)
    assert sorted(proj.choices()) == tuning_rows(32)
    wide = torch.randn(ROW_BUCKETS[-1] + 1, 64, generator=g)
    torch.testing.assert_close(proj(wide), F.linear(wide, w, b), rtol=1e-4, atol=1e-4)
    assert sorted(proj.choices()) == tuning_rows(32)


def test_small_weights_are_not_timed():
    w = torch.randn(32, 8)
    proj = Projection(w)
    x = torch.randn(2, 8)
    torch.testing.assert_close(proj(x), F.linear(x, w))
    assert not proj.autotune and proj.choices() == {} and projection.TABLE == {}


def test_a_timing_streams_the_weights_of_its_shape_up_to_the_byte_budget(monkeypatch):
    """Timed over several weights, as a forward meets them (one weight timed again and again stays in the cache)."""
    seen = []
    monkeypatch.setitem(LAYOUTS, "linear", lambda x, w: seen.append(w.data_ptr()) or F.linear(x, w))
    ws = [torch.randn(64, 32) for _ in range(5)]
    monkeypatch.setattr(projection, "TIMING_BYTES", 3 * ws[0].numel() * ws[0].element_size())
    projection.layout_for(ws, torch.randn(2, 32))
    assert set(seen) == {w.data_ptr() for w in ws[:3]}


def test_a_shape_with_few_weights_is_timed_over_several_products(monkeypatch):
    """One weight is cycled through until the byte budget streams (one short call would time the threads'
    wake-up, not the layout), and the table keeps seconds per product."""
    calls = []
    monkeypatch.setitem(LAYOUTS, "linear", lambda x, w: calls.append(w.data_ptr()) or F.linear(x, w))
    w = torch.randn(64, 32)
    monkeypatch.setattr(projection, "TIMING_BYTES", 5 * w.numel() * w.element_size())
    monkeypatch.setattr(projection, "MAX_TIMING_CALLS", 4)
    projection.layout_for([w], torch.randn(2, 32))
    assert len(calls) == 1 + projection.TIMING_REPEATS * 4          # warm-up, then bursts of MAX_TIMING_CALLS
    key = ((64, 32), torch.float32, torch.get_num_threads(), 2)
    assert 0 < projection.TABLE[key]["linear"] < 0.01


class TwoLayers(torch.nn.Module):
    def __init__(self, big: int):
        super().__init__()
        self.a = torch.nn.Linear(64, big, bias=True)
        self.b = torch.nn.Linear(64, big, bias=False)     # same shape: timed together with a
        self.small = torch.nn.Linear(64, 32)
        self.lm_head = torch.nn.Linear(64, big)

    def get_output_embeddings(self):
        return self.lm_head


def test_few_row_linears_reroute_few_row_products_of_big_layers_and_nothing_else():
    g = torch.Generator().manual_seed(1)
    model = TwoLayers(projection.MIN_TUNED_ELEMENTS // 64)
    mode = FewRowLinears(model)
    assert mode.modules == [model.a, model.b]    # not the small layer, not the LM head
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(1, rows, 64, generator=g)
            want = [F.linear(x, model.a.weight, model.a.bias), F.linear(x, model.b.weight), model.small(x)]
            with mode:
                got = [model.a(x), model.b(x), model.small(x)]
            for a, b in zip(got, want):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert mode.rerouted == 4
        wide = torch.randn(MAX_LAYER_ROWS + 1, 64, generator=g)
        with mode:
            torch.testing.assert_close(model.a(wide), F.linear(wide, model.a.weight, model.a.bias), rtol=1e-4, atol=1e-4)
    assert mode.rerouted == 4                       # more rows than MAX_LAYER_ROWS: the module's own product
    # One timing per (shape, row count), shared by both layers.
    assert sorted(k[3] for k in projection.CHOICE) == [1, 3]
    # With gradients on (training), nothing is rerouted; outside ``with`` no hook is left behind.
    with mode:
        out = model.a(torch.randn(2, 64, generator=g))
    assert out.requires_grad and mode.rerouted == 4
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    # A caller that knows its largest forward (a bench: its longest prefill) times up to that one's bucket.
    projection.CHOICE.clear()
    mode.tune(40)
    assert sorted(k[3] for k in projection.CHOICE) == tuning_rows(40) == list(range(1, MAX_TUNED_ROWS + 1)) + [24, 32, 48]
    mode.tune()
    assert sorted(k[3] for k in projection.CHOICE) == tuning_rows(MAX_LAYER_ROWS)


def test_few_row_linears_only_for_models_with_big_layers():
    from conftest import tiny_model
    tiny = tiny_model("llama")
    assert isinstance(few_row_linears(tiny), nullcontext)
    assert isinstance(few_row_linears(tiny, None, min_elements=1), FewRowLinears)
    # The LM head alone does not count: it is a Projection already.
    head = tiny.get_output_embeddings().weight.numel()
    assert max(m.weight.numel() for m in tiny.modules() if isinstance(m, torch.nn.Linear)
               and m is not tiny.get_output_embeddings()) < head
    assert isinstance(few_row_linears(tiny, min_elements=head), nullcontext)


def test_products_in_a_precision_the_cpu_emulates_are_neither_timed_nor_rerouted(monkeypatch):
    from conftest import tiny_model
    assert not projection.emulated(torch.float32)
    assert projection.emulated(torch.bfloat16) == (not (torch.backends.mkldnn.is_available()
                                                        and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    model = tiny_model("llama").to(torch.bfloat16)
    head = model.get_output_embeddings().weight
    x = torch.randn(3, head.shape[1], dtype=torch.bfloat16)
    monkeypatch.setattr(projection, "emulated", lambda dtype: dtype in (torch.bfloat16, torch.float16))
    assert projection.routable(model, min_elements=1) == [] and isinstance(few_row_linears(model, min_elements=1), nullcontext)
    proj = Projection(head, min_elements=1)
    assert not proj.autotune
    torch.testing.assert_close(proj(x), F.linear(x, head))
    assert projection.layout_for([head], x) == "linear" and projection.TABLE == {}   # nothing timed
    monkeypatch.setattr(projection, "emulated", lambda dtype: False)                 # a CPU with BF16 instructions
    assert projection.routable(model, min_elements=1) and Projection(head, min_elements=1).autotune


class Block(torch.nn.Module):
    def __init__(self, big: int):
        super().__init__()
        self.up = torch.nn.Linear(64, big, bias=False)
        self.down = torch.nn.Linear(big, 64, bias=False)

    def forward(self, x):
        return self.down(self.up(x))


class Stack(torch.nn.Module):
    """Two decoder layers (a ModuleList) of products big enough to reroute."""

    def __init__(self, big: int):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(big), Block(big)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_reroute_only_the_products_whose_layout_saves_more_than_rerouting_costs(monkeypatch):
    """A rerouted product pays for the hooks; inside a decoder layer it is hooked only at row counts
    where its timed layout saves more than that, and untimed row counts are rerouted (and so timed)."""
    g = torch.Generator().manual_seed(2)
    model = Stack(projection.MIN_TUNED_ELEMENTS // 64)
    monkeypatch.setattr(projection, "routing_cost", lambda: 1e-4)
    threads = torch.get_num_threads()
    for m in (model.layers[0].up, model.layers[0].down):
        for rows, (slow, fast) in {1: (1.5e-4, 0.9e-4), 3: (1e-2, 1e-3)}.items():   # seconds per product
            key = (tuple(m.weight.shape), m.weight.dtype, threads, rows)
            projection.TABLE[key] = {"linear": slow, "weight-major": fast}
            projection.CHOICE[key] = "weight-major"
    mode = FewRowLinears(model)
    assert set(mode.layers) == set(model.layers) and mode.loose == []
    with torch.no_grad():
        for rows, added in ((1, {0}), (3, {4}), (1, {0}), (2, {2, 4}), (3, {4})):
            x = torch.randn(1, rows, 64, generator=g)
            want = model(x)
            before = mode.rerouted
            with mode:
                got = model(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert mode.rerouted - before in added, f"{rows} rows: {mode.rerouted - before} products rerouted"
    # One row saves 50 us a product against 100 us of rerouting; three save 4.5 ms. Two rows were
    # untimed: the first layer's products were rerouted and timed, the second layer went by that timing.
    assert (tuple(model.layers[0].up.weight.shape), torch.float32, threads, 2) in projection.TABLE
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())   # all gone on exit


def test_packing_works_wherever_torch_has_onednn():
    """The packed layout is a candidate on every CPU build with oneDNN (the x86 wheels CI installs),
    so the packed tests below never pass by having nothing to test."""
    assert torch.backends.mkldnn.is_available(), "this torch build has no oneDNN: the packed layout is never used"
    assert projection.packing_works(torch.float32)
    assert "packed" in candidate_layouts(1) and "packed" in candidate_layouts(16)


def test_packed_weights_follow_their_weight_and_are_released_with_it():
    """A packed copy is made once per weight, made again after the weight changes in place (as training
    changes heads between evaluations), and dropped when the weight is freed."""
    packed = projection.PackedWeights()
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 32, generator=g), torch.randn(5, 32, generator=g)
    first = packed(w)
    assert packed(w) is first and packed.bytes == w.numel() * 4
    with torch.no_grad():
        w.mul_(2.0)
    second = packed(w)
    assert second is not first and packed.bytes == w.numel() * 4
    out = torch.ops.mkldnn._linear_pointwise(x, second, None, "none", [], "")
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    del w, first, second
    assert packed.bytes == 0 and not packed._kept


def test_packed_copies_stop_at_their_memory_budget(monkeypatch):
    """Past the budget a weight is not packed and its products run as F.linear, still correct."""
    g = torch.Generator().manual_seed(2)
    a, b, x = torch.randn(96, 32, generator=g), torch.randn(96, 32, generator=g), torch.randn(3, 32, generator=g)
    packed = projection.PackedWeights(budget=a.numel() * 4)
    assert packed(a) is not None and packed(b) is None and packed.bytes == a.numel() * 4
    monkeypatch.setattr(projection, "PACKED", packed)
    for w in (a, b):
        torch.testing.assert_close(LAYOUTS["packed"](x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    for setting, budget in (("off", 0), ("0", 0), ("12", 12 << 20), ("0.5", 1 << 19)):
        monkeypatch.setenv(projection.PACKED_ENV, setting)
        assert projection.packed_budget() == budget
    monkeypatch.setenv(projection.PACKED_ENV, "auto")
    assert projection.packed_budget() > 0
    for bad in ("lots", "inf"):
        monkeypatch.setenv(projection.PACKED_ENV, bad)
        with pytest.raises(ValueError, match=f"SELFSPEC_CPU_PACKED='{bad}'"):
            projection.packed_budget()


def test_the_packed_layout_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(projection.PACKED_ENV, "0")
    projection.packing_works.cache_clear()
    try:
        assert "packed" not in candidate_layouts(4)
    finally:
        monkeypatch.delenv(projection.PACKED_ENV)
        projection.packing_works.cache_clear()
