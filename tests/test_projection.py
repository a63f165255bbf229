import pytest
import torch
from torch.nn import functional as F

from selfspec.projection import (LAYOUTS, MAX_TUNED_ROWS, MIN_TUNED_ELEMENTS, FewRowLinears, Projection, candidate_layouts,
                                 few_row_linears)


@pytest.mark.parametrize("name,rows", [(n, r) for r in (1, 2, 3, 4, 5) for n in candidate_layouts(r)])
def test_every_layout_computes_the_same_product(name, rows):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(300, 16, generator=g), torch.randn(rows, 16, generator=g)
    out = LAYOUTS[name](x, w)
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_tuned_projection_matches_linear_and_remembers_its_choice():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(MIN_TUNED_ELEMENTS // 64, 64, generator=g)
    b = torch.randn(w.shape[0], generator=g)
    proj = Projection(w, b)
    assert proj.autotune
    for shape in [(1, 64), (1, 3, 64), (4, 64)]:
        x = torch.randn(*shape, generator=g)
        out = proj(x)
        assert out.shape == (*shape[:-1], w.shape[0])
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    # One timing per row count, with every candidate layout measured (padding only for one row).
    assert sorted(proj.choice) == [1, 3, 4]
    assert set(proj.timings[1]) == set(candidate_layouts(1)) == {"linear", "weight-major", "weight-major-pad2"}
    assert set(proj.timings[3]) == {"linear", "weight-major", "weight-major-pairs"}
    assert set(proj.timings[4]) == {"linear", "weight-major", "weight-major-pairs"}
    assert all(proj.choice[r] == min(t, key=t.get) for r, t in proj.timings.items())
    before = dict(proj.timings)
    proj(torch.randn(3, 64, generator=g))
    assert proj.timings == before   # a seen row count is not timed again


def test_small_weights_are_not_timed():
    w = torch.randn(32, 8)
    proj = Projection(w)
    x = torch.randn(2, 8)
    torch.testing.assert_close(proj(x), F.linear(x, w))
    assert not proj.autotune and proj.choice == {}


def test_few_row_linears_route_big_few_row_products_and_nothing_else():
    g = torch.Generator().manual_seed(1)
    big = torch.nn.Linear(64, MIN_TUNED_ELEMENTS // 64, bias=True)
    twin = torch.nn.Linear(64, MIN_TUNED_ELEMENTS // 64, bias=False)   # same shape: shares the timings
    small = torch.nn.Linear(64, 32)
    mode = FewRowLinears()
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(1, rows, 64, generator=g)
            want = [F.linear(x, big.weight, big.bias), F.linear(x, twin.weight), small(x)]
            with mode:
                got = [big(x), twin(x), small(x)]
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        wide = torch.randn(MAX_TUNED_ROWS + 1, 64, generator=g)
        with mode:
            torch.testing.assert_close(big(wide), F.linear(wide, big.weight, big.bias), rtol=1e-4, atol=1e-4)
    # One timed Projection per big weight shape, each row count timed once; more rows than MAX_TUNED_ROWS untouched.
    (proj,) = mode.by_shape.values()
    assert sorted(proj.choice) == [1, 3]
    # With gradients on (training), nothing is rerouted.
    x = torch.randn(2, 64, generator=g)
    with mode:
        out = big(x)
    assert out.requires_grad and sorted(proj.choice) == [1, 3]


def test_few_row_linears_only_for_models_with_big_layers():
    from conftest import tiny_model
    from contextlib import nullcontext
    tiny = tiny_model("llama")
    assert isinstance(few_row_linears(tiny), nullcontext)
    assert isinstance(few_row_linears(tiny, None, min_elements=1), FewRowLinears)
    # The LM head alone does not count: it is a Projection already.
    head = tiny.get_output_embeddings().weight.numel()
    assert max(m.weight.numel() for m in tiny.modules() if isinstance(m, torch.nn.Linear)
               and m is not tiny.get_output_embeddings()) < head
    assert isinstance(few_row_linears(tiny, min_elements=head), nullcontext)
