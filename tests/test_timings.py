"""What one process times about the machine, a later one reads back (selfspec/timings.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from selfspec import decode, projection, timings
from selfspec.backbone import Backbone
from selfspec.budget import VerifyCost


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on, in a fresh directory, and this process seen as a fresh one (before and after)."""
    monkeypatch.setenv(timings.ENV, str(tmp_path / "timings"))
    monkeypatch.setattr(projection, "TABLE", {})
    monkeypatch.setattr(projection, "CHOICE", {})
    monkeypatch.setattr(projection, "_ROUTING_COST", [])
    timings.reset()
    yield tmp_path / "timings" / f"{timings.machine_key()}.json"
    timings.reset()


def _new_process(monkeypatch):
    """What a later process starts with: nothing timed in memory, the file as the last one left it."""
    timings.reset()
    monkeypatch.setattr(projection, "TABLE", {})
    monkeypatch.setattr(projection, "CHOICE", {})
    monkeypatch.setattr(projection, "_ROUTING_COST", [])


def _counting_layouts(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name, fn in list(projection.LAYOUTS.items()):
        monkeypatch.setitem(projection.LAYOUTS, name, lambda x, w, fn=fn, name=name: (calls.append(name), fn(x, w))[1])
    return calls


def test_a_layout_timed_once_is_read_back_by_a_later_process(store, monkeypatch):
    w, x = torch.randn(512, 64), torch.randn(3, 64)
    calls = _counting_layouts(monkeypatch)
    out = projection.project(x, w)
    assert len(calls) > len(projection.candidate_layouts(3))    # timed: every candidate, several times
    table, choice = dict(projection.TABLE), dict(projection.CHOICE)
    assert not store.exists(), "kept in memory until flushed"
    timings.flush()
    kept = json.loads(store.read_text())
    assert kept["format"] == timings.FORMAT and len(kept["entries"]) == 1

    _new_process(monkeypatch)
    calls.clear()
    again = projection.project(x, w)
    assert calls == [choice[next(iter(choice))]], "read back: only the product itself runs"
    assert projection.TABLE == table and projection.CHOICE == choice
    torch.testing.assert_close(again, out)


def test_the_verify_cost_prior_and_the_routing_cost_are_read_back(store, monkeypatch, one_thread):
    bb = Backbone(tiny_model("llama"))
    prior = VerifyCost(bb, context=8, sweeps=1).table(2, 4)
    routing = projection.routing_cost()
    timings.flush()

    _new_process(monkeypatch)
    def no_pass(*a, **k):
        raise AssertionError("the pass was timed again")
    monkeypatch.setattr(decode, "verify_rows", no_pass)
    monkeypatch.setattr(decode, "prefill_rows", no_pass)
    assert VerifyCost(bb, context=8, sweeps=1).table(2, 4) == prior
    monkeypatch.setattr(projection, "FewRowLinears", None)          # timing it would need the class
    assert projection.routing_cost() == routing
    # Another shape of prior (more sweeps, a wider tree) is a different entry: timed, not misread.
    with pytest.raises(AssertionError, match="timed again"):
        VerifyCost(bb, context=8, sweeps=2).table(2, 4)


def test_retime_times_afresh_and_replaces_what_was_kept(store, monkeypatch):
    w, x = torch.randn(512, 64), torch.randn(2, 64)
    projection.project(x, w)
    timings.flush()
    key = next(iter(json.loads(store.read_text())["entries"]))
    store.write_text(json.dumps({"format": timings.FORMAT, "entries": {key: {n: 1.0 for n in projection.candidate_layouts(2)}}}))

    _new_process(monkeypatch)
    timings.retime()
    calls = _counting_layouts(monkeypatch)
    projection.project(x, w)
    assert len(calls) > len(projection.candidate_layouts(2))
    timings.flush()
    assert set(json.loads(store.read_text())["entries"][key].values()) != {1.0}


def test_off_keeps_nothing_and_a_torn_or_foreign_file_is_timed_again(store, monkeypatch, tmp_path):
    w, x = torch.randn(512, 64), torch.randn(2, 64)
    monkeypatch.setenv(timings.ENV, "off")
    projection.project(x, w)
    timings.flush()
    assert timings.store_path() is None and not store.parent.exists()

    monkeypatch.setenv(timings.ENV, str(store.parent))
    store.parent.mkdir()
    for torn in ("{not json", json.dumps({"format": timings.FORMAT + 1, "entries": {}}), json.dumps([1, 2])):
        store.write_text(torn)
        _new_process(monkeypatch)
        calls = _counting_layouts(monkeypatch)
        projection.project(x, w)
        assert len(calls) > len(projection.candidate_layouts(2)), "an unreadable file is not trusted"
        timings.flush()
        assert len(json.loads(store.read_text())["entries"]) == 1, "and is rewritten whole"
        monkeypatch.undo()   # the counting wrappers go; the env and tables are set again below
        monkeypatch.setenv(timings.ENV, str(store.parent))

    # Another machine (CPU model) has its own file: nothing of this one's is read there.
    monkeypatch.setattr(timings, "_cpu_model", lambda: "another CPU")
    assert timings.store_path() != store
    _new_process(monkeypatch)
    assert timings.get(next(iter(json.loads(store.read_text())["entries"]))) is None


def test_two_processes_flushing_keep_both_processes_timings(store, monkeypatch):
    projection.project(torch.randn(2, 64), torch.randn(512, 64))
    timings.flush()
    _new_process(monkeypatch)
    projection.project(torch.randn(2, 32), torch.randn(512, 32))   # another shape, timed by "another process"
    timings.flush()
    assert len(json.loads(store.read_text())["entries"]) == 2


def test_a_store_that_cannot_be_written_warns_once_and_decoding_goes_on(store, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(timings.ENV, str(blocker))
    monkeypatch.setattr(timings, "_warned", False)
    projection.project(torch.randn(2, 64), torch.randn(512, 64))
    with pytest.warns(UserWarning, match="cannot keep this machine's timings in .*a-file.*writable directory, or to off"):
        timings.flush()
    projection.project(torch.randn(2, 32), torch.randn(512, 32))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timings.flush()                     # once is enough
    assert blocker.read_text() == "not a directory"
