"""gradsync.torch.DistributedOptimizer: ranks on their share of each batch take the steps of one
process on the whole batch (f32; bf16 within its rounding), every rank the same bits; a parameter
backward never reaches, and a .grad replaced behind its back, are named; a rank killed mid-training
fails the others naming it. broadcast_parameters: rank 0's bits everywhere."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from model import make_model, train_whole_batch  # noqa: E402


@pytest.mark.parametrize("ranks,machines,bucketing", [(2, 1, "fixed-size"), (4, 2, "time-clustered"),
                                                      (4, 1, "per-tensor")])
def test_ranks_take_the_steps_of_one_process_on_the_whole_batch(job, ranks, machines, bucketing):
    results, statuses = job.run("optimizer.py", ranks, "float32", bucketing, "none", "train", machines=machines)
    assert statuses == [0] * ranks, job.outputs
    assert all(r["ok"] for r in results), results
    whole = train_whole_batch()
    for r in results:
        assert r["parameters"] == results[0]["parameters"]  # the same bits on every rank
    for got, want in zip(results[0]["parameters"], whole):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    initial = [p.detach().flatten() for p in make_model().parameters()]
    assert any((torch.tensor(got) - start).abs().max() > 1e-3 for got, start in zip(results[0]["parameters"], initial))


def test_bf16_parameters_are_averaged_in_f32_and_stored_back(job):
    results, statuses = job.run("optimizer.py", 2, "bfloat16", "fixed-size", "none", "train")
    assert statuses == [0, 0], job.outputs
    assert results[0]["ok"] and results[1]["ok"], results
    assert results[1]["parameters"] == results[0]["parameters"]
    whole = train_whole_batch(torch.bfloat16)
    for got, want in zip(results[0]["parameters"], whole):
        torch.testing.assert_close(torch.tensor(got), want, rtol=3e-2, atol=3e-2)


def test_a_parameter_backward_never_reaches_is_named(job):
    results, _ = job.run("optimizer.py", 2, "float32", "per-tensor", "none", "unused")
    # Each rank names it, unless the other's failure reached it first.
    assert all(r["type"] in ("ValueError", "PeerFailed") for r in results), results
    named = [r for r in results if r["type"] == "ValueError"]
    assert named and all('"unused"' in r["message"] for r in named), results


def test_a_replaced_grad_is_named(job):
    results, _ = job.run("optimizer.py", 1, "float32", "fixed-size", "none", "replaced-grad")
    assert results[0]["type"] == "RuntimeError"
    assert "'0.bias'" in results[0]["message"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_broadcast_parameters_gives_every_rank_rank_0s_bits(job, ranks):
    results, statuses = job.run("broadcast.py", ranks)
    assert statuses == [0] * ranks, job.outputs
    expected = [p.detach().flatten().tolist() for p in make_model().parameters()]  # rank 0's: + 0
    for r in results:
        assert r["parameters"] == expected


def test_a_rank_killed_mid_training_fails_the_others_naming_it(job):
    results, statuses = job.run("optimizer.py", 3, "float32", "fixed-size", "none", "killed")
    assert statuses[2] == 9 or statuses[2] < 0
    for r in results[:2]:
        assert not r["ok"]
        assert r["type"] == "PeerFailed", r
        assert "rank 2" in r["message"]
