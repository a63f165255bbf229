"""Host reads per decoding step: what a GPU has to wait for.

Each read of a device tensor back to the host (``.tolist()``, ``.item()``, ``int()``/``float()``/``bool()``
of a tensor, ``.cpu()``, ``.numpy()``, ``nonzero``) stalls the host until the device has caught up. A
step needs one: the accepted lengths (``accept.greedy_accept_rows``, one read for every row). Width
fitting decides the pass's shape on the host, so it reads every row's draft once more (``read_host``);
a lookup graft reads the drafts it grafts onto, every row's at once (and then the fitting reads
nothing); the lookup drafter's own drafts are known on the host, so it reads only the accepted
lengths. On the CPU every tensor is on the host, so these tests count the calls themselves: any new
read in a step shows up here.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from selfspec.model import SelfSpeculativeModel, untrained_heads

PROMPT, NEW = 48, 40
PREFILL_READS = 2   # the prompt's ids and the first token (``decode_rows``, before the steps)
# Every way to read a tensor to the host, patched at the Python level: decoding runs under inference mode,
# where a TorchDispatchMode does not see the scalar reads (``_local_scalar_dense``).
READS = ("tolist", "cpu", "numpy", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero",
         "masked_select")


class _Reads:
    """Counts host reads of tensors while active."""

    def __init__(self):
        self.count = 0
        self._saved = {}

    def __enter__(self):
        targets = [(torch.Tensor, name) for name in READS] + [(torch, "nonzero"), (torch, "masked_select")]
        for owner, name in targets:
            orig = self._saved[owner, name] = getattr(owner, name)

            def counted(*a, _orig=orig, **k):
                self.count += 1
                return _orig(*a, **k)
            setattr(owner, name, counted)
        return self

    def __exit__(self, *exc):
        for (owner, name), orig in self._saved.items():
            setattr(owner, name, orig)
        return False


@pytest.mark.parametrize("inference", [False, True])
def test_the_counter_sees_every_kind_of_read(inference):
    """Outside and inside inference mode (where decoding runs)."""
    with torch.inference_mode(inference):
        t = torch.arange(4)
        with _Reads() as reads:
            t.tolist(), int(t[1]), float(t[2]), bool(t[0] > 1), t.sum().item(), t.cpu(), t.nonzero()
            torch.nonzero(t), t.masked_select(t > 1), range(10)[t[1]]
    assert reads.count == 10


def _reads_per_step(name: str, fit: bool, lookup: int = 0, rows: int = 1, *, plain: bool = False,
                    **settings) -> tuple[int, ...]:
    """(host reads in the decode's steps, its steps: loop iterations, each verifying every live row; with
    ``plain``, also the steps the back-off made plain, counted per row). settings: the drafter's threshold or
    gate (default 0: none)."""
    model = tiny_model("llama")
    kind = {"medusa": "medusa", "eagle": "eagle", "early-exit": "early-exit"}.get(name)
    heads = untrained_heads(kind, model, "t", exit_layer=1 if kind == "early-exit" else None) if kind else None
    kw = {"lookup": lookup} if kind in ("medusa", "eagle") else {}
    if name not in ("none", "lookup"):
        kw |= {"threshold": 0.0} | ({"gate": 0.0} if name == "medusa" else {}) | settings
    if name == "draft-model":
        kw["draft_model"] = tiny_model("llama", seed=1, num_hidden_layers=1)
    sm = SelfSpeculativeModel(model, None, drafter_name=name, heads=heads, name="t", fit_width=fit, **kw)
    # A prompt that repeats itself, so that the lookup finds matches to graft.
    ids = (torch.arange(1, PROMPT + 1)[None] + torch.arange(rows)[:, None]) % 17 + 3
    sm.generate(ids, max_new_tokens=NEW)   # warm-up: width fitting times its prior here
    with _Reads() as reads:
        sm.generate(ids, max_new_tokens=NEW)
    out = reads.count - PREFILL_READS * rows, sm.last_stats.target_forwards - 1
    return (*out, sm.last_stats.plain_steps) if plain else out


@pytest.mark.parametrize("name", ["none", "medusa", "eagle"])
def test_a_step_reads_the_host_once(name, one_thread):
    """Without fitting or a lookup, every step reads the host once: for the accepted lengths."""
    reads, steps = _reads_per_step(name, fit=False, lookup=0)
    assert reads == steps, f"{name}: {reads} host reads in {steps} steps"


@pytest.mark.parametrize("fit", [False, True])
def test_the_lookup_alone_reads_the_host_once_a_step(fit, one_thread):
    """The lookup drafter's drafts are the rows' pending tokens (known on the host) with copies grafted on:
    neither the graft nor width fitting reads the device; only acceptance does."""
    reads, steps = _reads_per_step("lookup", fit=fit, lookup=4)
    assert reads == steps, f"lookup (fit={fit}): {reads} host reads in {steps} steps"


@pytest.mark.parametrize("name", ["lookup", "medusa", "eagle"])
def test_fitting_and_grafting_add_one_read_a_step(name, one_thread):
    """With width fitting and a lookup, a step reads its drafts once more (the graft's read serves the fit),
    and EAGLE reads each drafted level's scores where fitting prices the levels (at most depth - 1)."""
    reads, steps = _reads_per_step(name, fit=True, lookup=4)
    levels = 4 if name == "eagle" else 0   # the EAGLE head's default depth 5: four priced levels at most
    assert reads <= (2 + levels) * steps, f"{name}: {reads} host reads in {steps} steps"


@pytest.mark.parametrize("name", ["lookup", "medusa", "eagle"])
def test_a_batch_step_reads_as_often_as_a_one_row_step(name, one_thread):
    """Four rows, each grafting copies: a step reads every row's draft in one transfer and every row's
    accepted length in one more, not once a row."""
    reads, steps = _reads_per_step(name, fit=False, lookup=4, rows=4)
    assert reads <= 2 * steps, f"{name}: {reads} host reads in {steps} steps of 4 rows"


@pytest.mark.parametrize("name", ["early-exit", "draft-model"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_chain_drafter_reads_once_a_chain_step_and_only_under_a_threshold(name, rows, one_thread):
    """Early exit and the draft model draft a chain: without a threshold it is always drafted whole, so a step
    reads the host once (the accepted lengths: the chain's next tokens feed the next draft call on the device);
    with one, each chain step reads every row's confidences in one more read, to stop where a row's chain is too
    doubtful (the tree is cut with what it read: nothing more). Chains of 4 (the default tree)."""
    reads, steps = _reads_per_step(name, fit=False, rows=rows)
    assert reads == steps, f"{name}: {reads} host reads in {steps} steps of {rows} row(s)"
    reads, steps = _reads_per_step(name, fit=False, rows=rows, threshold=0.05)
    assert reads <= (1 + 4) * steps, f"{name}, threshold: {reads} host reads in {steps} steps of {rows} row(s)"


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("fit", [False, True])
def test_a_gated_medusa_step_reads_its_drafts_once(rows, fit, one_thread):
    """Medusa under a gate (the shipped heads' setting) cuts each row's tree on the host: every row's
    confidences, node tokens and path probabilities come back in one read, which the lookup's graft and
    width fitting reuse, so a step reads twice however many rows it has (the default path: gate, lookup,
    fitting). A step the back-off (on with fitting) makes plain reads once."""
    reads, steps, plain = _reads_per_step("medusa", fit=fit, lookup=4 if fit else 0, rows=rows, gate=0.5, plain=True)
    drafted = steps - plain // rows   # (a plain step is plain for every row; how many follows this machine's timings)
    assert reads <= steps + drafted, f"medusa, gate: {reads} reads in {steps} steps ({drafted} drafted), {rows} row(s)"


def test_the_step_benchmark_counts_each_steps_operations():
    """scripts/step_cost.py (issue 62's benchmark of a step's host work) runs, and its eager table gives each
    method's dispatched operations per step beside the milliseconds: transformers' token and the plain loop's
    step make a few hundred, and EAGLE's step (four draft levels, the commit, the cut) makes more than the plain
    loop's. The counts do not follow the machine's load: two runs give the same."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "step_cost.py"

    def table() -> dict[str, list[str]]:
        out = subprocess.run([sys.executable, str(script), "--runs", "1", "--new", "12", "--drafters", "none,eagle"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        return {r[0].strip(): [c.strip() for c in r[1:]] for r in (line.strip("|").split("|") for line in out[3:])}

    first, second = table(), table()
    ops = {name: float(cells[3]) for name, cells in first.items()}
    assert set(ops) == {"transformers generate", "selfspec none", "selfspec eagle"}, first
    assert 100 < ops["selfspec none"] < 1000 and 100 < ops["transformers generate"] < 1000, first
    assert ops["selfspec eagle"] > ops["selfspec none"], first
    assert {n: c[3] for n, c in first.items()} == {n: c[3] for n, c in second.items()}, (first, second)
