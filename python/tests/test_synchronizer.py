"""gradsync.Synchronizer from Python: averages over 2 and 4 processes, every rank the same bits;
bad settings and misuse named; a dead peer; the GIL released while wait() blocks."""
import json

import numpy as np
import pytest

import gradsync


def expected_average(ranks, step, shapes):
    arrays = []
    for rank in range(ranks):
        generator = np.random.default_rng(1000 * step + rank)
        arrays.append([generator.normal(0.0, 0.01, shape) for shape in shapes])
    return [np.mean([a[i] for a in arrays], axis=0) for i in range(len(shapes))]


@pytest.mark.parametrize("ranks,machines,bucketing,codec,topology", [
    (2, 1, "fixed-size", "none", "ring"),
    (3, 1, "fixed-size", "none", "auto"),
    (4, 1, "time-clustered", "none", "recursive-doubling"),
    (4, 1, "fixed-size", "none", "halving-doubling"),
    (4, 2, "time-clustered", "none", "hierarchical"),
    (4, 2, "fixed-size", "none", "auto"),  # on 2 machines of 2: the links measured per level
    (4, 1, "per-tensor", "none", "parameter-server"),
])
def test_average_on_every_rank(job, ranks, machines, bucketing, codec, topology):
    steps = 3
    results, statuses = job.run("average.py", ranks, bucketing, codec, topology, steps, machines=machines)
    assert statuses == [0] * ranks, job.outputs
    assert [r["rank"] for r in results] == list(range(ranks))
    for step in range(steps):
        expected = expected_average(ranks, step, [(64 * 33,), (33,), (17,)])
        for r in results:
            assert r["left"][step] == results[0]["left"][step]  # the same bits everywhere
            for got, want in zip(r["left"][step], expected):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_a_lossy_codec_with_error_feedback_keeps_every_rank_equal(job):
    results, statuses = job.run("average.py", 2, "fixed-size", "ef-two-bit", "ring", 3)
    assert statuses == [0, 0], job.outputs
    for step in range(3):
        assert results[1]["left"][step] == results[0]["left"][step]


@pytest.mark.parametrize("setting,value", [("bucketing", "by-size"), ("codec", "four-bit"), ("topology", "star"),
                                           ("executor", "eager"), ("timeout", 0)])
def test_bad_settings_raise_value_error_naming_them(setting, value):
    with pytest.raises(ValueError, match=str(value) if value else "timeout"):
        gradsync.Synchronizer(**{setting: value})


def test_arrays_gradsync_cannot_average_are_refused_by_name():
    sync = gradsync.Synchronizer()
    with pytest.raises(ValueError, match='"ints" is int32'):
        sync.add("ints", np.zeros(4, dtype=np.int32))
    with pytest.raises(ValueError, match='"strided" is not contiguous'):
        sync.add("strided", np.zeros((4, 4), dtype=np.float32)[:, 1])
    with pytest.raises(TypeError, match='"listed"'):
        sync.add("listed", [0.0, 1.0])
    with pytest.raises(KeyError, match='"nameless"'):
        sync.ready("nameless")


def test_a_gradient_never_marked_ready_is_named(job):
    results, _ = job.run("errors.py", 1, "never-ready")
    assert results[0]["type"] == "ValueError"
    assert '"b"' in results[0]["message"]


def test_a_dead_peer_raises_peer_failed_naming_it(job):
    results, statuses = job.run("errors.py", 2, "dead-peer")
    assert statuses[1] == 3
    assert results[0]["type"] == "PeerFailed"
    assert "RuntimeError" in results[0]["bases"]
    assert "rank 1" in results[0]["message"]


def test_wait_releases_the_gil(job):
    results, statuses = job.run("errors.py", 2, "gil")
    assert statuses == [0, 0], job.outputs
    assert results == [{"ok": True}, {"ok": True}]


def test_the_timeline_is_written_when_the_synchronizer_goes(tmp_path):
    path = tmp_path / "trace.json"
    sync = gradsync.Synchronizer(timeline=str(path))
    weight = np.ones(1000, dtype=np.float32)
    sync.add("weight", weight)
    sync.ready("weight")
    sync.wait()
    assert sync.last_iteration["iteration"] == 0
    (bucket,) = sync.last_iteration["schedules"]  # one rank: the topology's own name, no prediction
    assert bucket["schedule"] and bucket["seconds"] > 0
    del sync
    traces = list(tmp_path.glob("trace*.json"))
    assert len(traces) == 1, traces
    events = json.loads(traces[0].read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any("weight" in json.dumps(e) for e in events)
