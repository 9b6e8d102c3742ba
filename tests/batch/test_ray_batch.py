"""The batch job over Ray Data: the single-process job's output (the oracle), each id once even
when a worker actor is SIGKILLed mid-job.

Ray is an optional extra: the cases that start Ray are in tests/slow_cases.txt (`make test-slow`
installs the extra); the fast case runs the actor's callable in this process.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from test_batch import assert_same_outputs, read_output, write_requests

from kvjax.batch import run_batch
from kvjax.batch.job import pending_lines
from kvjax.batch.ray_job import EngineBatchWorker
from kvjax.engine.config import EngineConfig
from kvjax.testing import tiny_chat_model

CONFIG = EngineConfig(max_num_seqs=4, num_pages=48)


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def single_process(model, tmp_path_factory):
    """(input path, the single-process job's output by id) on 16 requests plus a bad line."""
    root = tmp_path_factory.mktemp("ray_batch")
    write_requests(root / "in.jsonl", num=16)
    with open(root / "in.jsonl", "a") as f:
        f.write('{"id": "big", "prompt_ids": [1, 500]}\n{"id": "r3", "prompt_ids": [1]}\n')
    run_batch(model, root / "in.jsonl", root / "single.jsonl", order="prefix",
              engine_config=CONFIG)
    return root / "in.jsonl", read_output(root / "single.jsonl")


def _factory_recording_pid(directory: str):
    """The model, built in a Ray actor that leaves its pid in `directory`."""
    with open(os.path.join(directory, f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    return tiny_chat_model()


@pytest.fixture
def ray_cluster():
    from kvjax.parallel.ray_local import init_local_ray

    init_local_ray(2)
    import ray
    import ray.cloudpickle

    # Actors cannot import this test module: its functions travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}, "loopback only"
    yield ray
    ray.shutdown()


def test_worker_batches_give_the_single_process_output(model, single_process, tmp_path):
    """The actor's callable, called here on batches of 5 lines."""
    input_path, expected = single_process[0], dict(single_process[1])
    items = [i for i in pending_lines(input_path, set()) if isinstance(i, tuple)]
    worker = EngineBatchWorker(functools.partial(tiny_chat_model),
                               dict(order="prefix", engine_config=CONFIG))
    got = {}
    for start in range(0, len(items), 5):
        lines, numbers = zip(*items[start:start + 5], strict=True)
        out = worker({"line": np.asarray(lines, object), "line_number": np.asarray(numbers)})
        assert len(out["record"]) == len(lines) and out["prefill_tokens"][0] > 0
        got.update((r["id"], r) for r in map(json.loads, out["record"]))
    repeat = expected.pop("r3@line:18")
    assert repeat["field"] == "id" and "r3@line:18" not in got
    assert expected.pop("big")["field"] == got.pop("big")["field"] == "prompt"
    assert_same_outputs(got, expected)


def test_ray_job_output_equals_the_single_process_job(ray_cluster, single_process, tmp_path):
    from kvjax.batch.ray_job import run_batch_ray

    input_path, expected = single_process[0], dict(single_process[1])
    stats = run_batch_ray(tiny_chat_model, input_path, tmp_path / "out.jsonl", num_workers=2,
                          batch_size=4, order="prefix", engine_config=CONFIG)
    got = read_output(tmp_path / "out.jsonl")
    assert stats.num_done == len(expected) and stats.num_errors == 2
    assert got.pop("big")["field"] == expected.pop("big")["field"]
    assert got.pop("r3@line:18") == expected.pop("r3@line:18")
    assert_same_outputs(got, expected)
    assert stats.prefill_tokens > 0 and stats.generated_tokens == 5 * len(expected)
    rerun = run_batch_ray(tiny_chat_model, input_path, tmp_path / "out.jsonl", num_workers=2)
    assert rerun.num_done == 0 and rerun.num_skipped == len(got) + 2


def test_ray_job_writes_each_id_once_after_a_worker_is_killed(ray_cluster, single_process,
                                                              tmp_path):
    from kvjax.batch.ray_job import run_batch_ray

    input_path, expected = single_process[0], dict(single_process[1])
    pids, output = tmp_path / "pids", tmp_path / "out.jsonl"
    pids.mkdir()
    killed = []

    def kill_one_worker_mid_job():
        # Once some batches are out (the two bad lines come first) and others are not, a
        # live worker dies as in a crash.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done = output.read_bytes().count(b"\n") if output.exists() else 0
            if 4 <= done < len(expected) - 8 and os.listdir(pids):
                pid = int(sorted(os.listdir(pids))[0].split("-")[0])
                os.kill(pid, signal.SIGKILL)
                killed.append(done)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_one_worker_mid_job)
    killer.start()
    stats = run_batch_ray(functools.partial(_factory_recording_pid, str(pids)), input_path,
                          output, num_workers=2, batch_size=2, order="prefix",
                          engine_config=CONFIG)
    killer.join()
    assert killed, "the job ended before a worker could be killed"
    assert len(os.listdir(pids)) > 2, "a killed worker is replaced by a restarted actor"
    got = read_output(output)  # Fails on an id written twice.
    assert stats.num_done == len(got) == len(expected)
    for rid in ("big", "r3@line:18"):
        assert got.pop(rid)["field"] == expected.pop(rid)["field"]
    assert_same_outputs(got, expected)
