"""Data parallelism: the pieces as plain functions (sharding, merging the ranks' trees, reducing
their numbers), then real `torchrun --nproc_per_node=2` runs on CPU (gloo) against one process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from magrpo.advantage import assign_advantages
from magrpo.distributed import World
from magrpo.metrics import Counter, Gauge, Maximum, reduce_over_ranks
from magrpo.rollout import expand_trees, merge_rollouts, portable
from magrpo.run_io import tree_records
from tests.conftest import ROOT, SMALL
from tests.fakes import PROBLEMS, SAMPLING, FakeBackend, FakeEnv, advantage_settings, serial, tree_settings


@pytest.mark.parametrize("count,size", [(4, 2), (3, 2), (5, 3), (2, 2), (7, 1)])
def test_shards_are_contiguous_cover_everything_and_differ_by_at_most_one(count, size):
    shards = [World(rank, size).shard(count) for rank in range(size)]
    assert shards[0][0] == 0 and shards[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
    sizes = [stop - start for start, stop in shards]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def _rollout(problems, mode="cross", threshold=2.0):
    env = FakeEnv(2)
    tree = tree_settings(num_generations=2, num_turns=3, joint_mode=mode, early_termination_threshold=threshold)
    rollout = expand_trees(problems, env, FakeBackend(), serial(lambda **kw: ["x", "y"], env), tree, SAMPLING)
    assign_advantages(rollout.nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="mean",
                                                        scale="none"))
    return rollout


@pytest.mark.parametrize("mode", ["align", "cross"])
def test_merged_shards_give_the_single_process_trees(mode):
    """Trees expanded in two shards and merged: the same records (ids, parents, children, rewards,
    returns, advantages) as one expansion of the whole batch; the fake backend's texts carry a
    counter, so texts (and the id that spells it) are compared without it."""
    problems = [*PROBLEMS, {"prompt": "P2", "offset": 0.5}]
    whole = _rollout(problems, mode)
    parts = [portable(_rollout(problems[:2], mode), 0), portable(_rollout(problems[2:], mode), 2)]
    merged = merge_rollouts(parts)

    def shape(records):
        for record in records:
            for node in record["nodes"]:
                node["completions"] = [[text.split("u")[0] for text in agent] for agent in node["completions"]]
                node["completion_ids"] = [[ids[:1] for ids in agent] for agent in node["completion_ids"]]  # the same
        return records

    assert shape(tree_records(1, merged.problems, merged.nodes)) == shape(tree_records(1, whole.problems, whole.nodes))
    assert [n.turn for n in merged.nodes] == sorted(n.turn for n in merged.nodes)  # turn-major, as one process builds
    assert merged.terminated_per_turn == whole.terminated_per_turn
    # texts and ids travel (rollouts.jsonl records them, the tool metrics count their masks), log-probs not
    assert all(c.token_ids and c.logprobs is None for n in merged.nodes for agent in n.completions for c in agent)


def test_rank_metrics_merge_by_their_kind():
    merged = reduce_over_ranks([{"env/sandbox_runs": Counter(10), "perf/rate": Gauge(4.0), "mem": Maximum(1.5),
                                 "expert/reference": 1.0, "runs_unmarked": 10},
                                {"env/sandbox_runs": Counter(7), "perf/rate": Gauge(2.0), "mem": Maximum(2.5),
                                 "only/one": Counter(3), "runs_unmarked": 7}])
    # counters add up, gauges (and unmarked numbers, integers too) average, maxima take the largest
    assert merged == {"env/sandbox_runs": 17, "perf/rate": 3.0, "mem": 2.5, "expert/reference": 1.0,
                      "runs_unmarked": 8.5, "only/one": 3}
    with pytest.raises(TypeError, match="mixed kinds"):
        reduce_over_ranks([{"x": Counter(1)}, {"x": Gauge(1)}])


# ---------------------------------------------------------------- torchrun on CPU

# B=3 trees over 2 processes: an uneven split (2 + 1), so a per-rank loss normaliser would show.
# A small lr keeps Adam's sign-like first steps from turning reduction-order noise into different samples.
# Rows decoded one at a time (max_batch_rows=1): a process decodes fewer trees per call than one process
# does, and other batch shapes can round the logits otherwise and, at a near tie, swap a token
# (tests/near_ties.py): the rollouts are then byte-identical on every CPU, not only where no tie fell.
RUN = [*SMALL, "trainer.steps=3", "trainer.batch_size=3", "generation.max_new_tokens=10", "trainer.lr=1e-5",
       "eval.every=1", "eval.at_end=false", "eval.max_problems=3", "checkpoint.every=1", "checkpoint.keep=5",
       "generation.max_batch_rows=1"]


def run(run_dir, procs: int, *overrides):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs > 1 else [sys.executable]
    proc = subprocess.run([*launcher, "train.py", *RUN, f"logging.run_dir={run_dir}", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def metrics(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in open(run_dir / "metrics.jsonl")]


def lora(run_dir, step):
    return {a: torch.load(run_dir / "checkpoints" / f"step_{step:06d}" / f"agent_{a}" / "train.pt")["params"]
            for a in (0, 1)}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dp") / "one"
    run(run_dir, 1)
    return run_dir


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dp") / "two"
    err = run(run_dir, 2)
    assert "2 processes" in err and err.count("magrpo: done") == 1  # rank 0 alone reports
    return run_dir


@pytest.mark.slow
def test_two_processes_sample_the_same_trees_and_log_the_same_metrics(single, two):
    assert (two / "rollouts.jsonl").read_bytes() == (single / "rollouts.jsonl").read_bytes()
    one, dp = metrics(single), metrics(two)
    assert [m["step"] for m in dp] == [1, 2, 3]
    for a, b in zip(one, dp):
        assert a.keys() == b.keys()
        for key in a:  # loss and log-prob mismatch are sums of ~1e-9 terms: compare with an absolute floor
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert any(m["train/agent_0/grad_norm"] > 0 for m in one)
    assert any(key.startswith("eval/") for key in dp[0])  # evaluation ran sharded too


@pytest.mark.slow
def test_two_processes_end_with_the_single_process_adapters(single, two):
    first = lora(single, 1)
    for step in (1, 2, 3):
        one, dp = lora(single, step), lora(two, step)
        for a in (0, 1):
            if step > 1:  # the tolerance (1e-6) is far below what training moves the weights by: an Adam
                # step moves a weight by up to ~lr (1e-5), so the largest move is about lr, not surely above it
                assert max(float((p - q).abs().max()) for p, q in zip(one[a], first[a])) > 5e-6
            for p, q in zip(one[a], dp[a]):
                torch.testing.assert_close(q, p, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_full_weight_agent_trains_the_same_in_two_processes(tmp_path):
    """agents[0].finetune=full: its gradients are summed over the ranks as the adapters' are, so two
    processes end with the one process's weights and trees."""
    from tests.test_resume import adapters

    full = ["agents=[{finetune: full},{}]", "trainer.steps=2", "eval.every=0", "checkpoint.every=0"]
    run(tmp_path / "one", 1, *full)
    run(tmp_path / "two", 2, *full)
    assert (tmp_path / "two" / "rollouts.jsonl").read_bytes() == (tmp_path / "one" / "rollouts.jsonl").read_bytes()
    one, two = adapters(tmp_path / "one"), adapters(tmp_path / "two")
    assert one.keys() == two.keys() == {"agent_0", "agent_1"} and "lm_head.weight" not in one["agent_0"]
    for agent in one:
        for name, value in one[agent].items():
            torch.testing.assert_close(two[agent][name], value, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_two_process_run_resumes_from_its_checkpoint(tmp_path, single):
    run_dir = tmp_path / "resumed"
    run(run_dir, 2, "trainer.steps=2")
    trainer_state = torch.load(run_dir / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)
    assert len(trainer_state["ranks"]) == 2  # each process's RNG and env counters
    err = run(run_dir, 2, "resume=auto")
    assert "resuming from" in err
    assert (run_dir / "rollouts.jsonl").read_bytes() == (single / "rollouts.jsonl").read_bytes()
    for p, q in zip(lora(single, 3)[1], lora(run_dir, 3)[1]):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0)
    # A refusal found by rank 0 (here a changed config) stops both processes at once, nothing written.
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py", *RUN, f"logging.run_dir={run_dir}", "resume=auto", "trainer.lr=0.5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    # no traceback from magrpo's own files (torchrun prints its own ChildFailedError one)
    assert proc.returncode != 0 and os.path.join(ROOT, "magrpo", "") not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error: resume: the config differs")]
    # Whichever process reports first, torchrun stops the other: rank 1 got the error from rank 0.
    assert errors and "trainer.lr (1e-05 -> 0.5)" in errors[0], proc.stderr[-3000:]
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before


@pytest.mark.slow
def test_no_gloo_thread_outlives_a_finished_run(tmp_path):
    """Loading the model imports torch.distributed.nn after init_process_group; its default
    arguments used to keep the process group alive past World.close(), leaving gloo's threads to
    interpreter shutdown, which now and then aborted a finished run ("terminate called without an
    active exception", SIGABRT). Every rank must end with no gloo thread alive after close()."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "tests/gloo_exit_probe.py", *RUN, f"logging.run_dir={tmp_path / 'run'}", "trainer.steps=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = sorted(line for line in proc.stderr.splitlines() if "gloo threads after close" in line)
    assert reports == [f"rank {r}: gloo threads after close: []" for r in (0, 1)], reports


@pytest.mark.parametrize("overrides,env,key,says", [
    (["trainer.batch_size=2"], {}, "trainer.batch_size", "number of processes"),
    # backend=vllm itself runs under torchrun (tests/test_vllm_train.py), its engine out of process only
    (["trainer.batch_size=8", "backend=vllm"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "backend", "VLLM_ENABLE_V1"),
])
def test_torchrun_settings_that_cannot_work_are_one_line_errors(monkeypatch, overrides, env, key, says):
    from magrpo.errors import ConfigError
    from magrpo.validation import validate
    from tests.conftest import compose

    monkeypatch.setenv("WORLD_SIZE", "4")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        validate(compose([*SMALL, *overrides]))
    assert e.value.key == key and says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_every_process_and_resumes(tmp_path):
    """torchrun forwards SIGTERM to every process: they finish the step together, rank 0 writes one
    checkpoint, and `resume=auto` under torchrun continues to the uninterrupted run's rollouts. The
    uninterrupted run has 2 processes too: every decode batch has its shape, so batched decoding
    (max_batch_rows=0, faster than RUN's one row at a time) gives the same bits."""
    settings = ["trainer.steps=6", "eval.every=0", "checkpoint.every=100", "generation.max_new_tokens=24",
                "generation.max_batch_rows=0"]
    reference = tmp_path / "reference"
    run(reference, 2, *settings)
    run_dir = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *RUN,
           f"logging.run_dir={run_dir}", *settings]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").is_file() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert err.count("finishing this step") == 2 and "checkpoint written" in err
    steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert steps[-1] < 6, "the signal came too late to test anything"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{steps[-1]:06d}"]
    run(run_dir, 2, *settings, "resume=auto")
    assert (run_dir / "rollouts.jsonl").read_bytes() == (reference / "rollouts.jsonl").read_bytes()


@pytest.mark.slow
def test_an_out_of_memory_on_one_process_is_retried_without_breaking_the_all_reduce(tmp_path, single):
    """Rank 1 alone halves its micro-batch and redoes its forward/backward; the gradients summed
    afterwards are the same, so the run still ends with the single-process adapters."""
    run_dir = tmp_path / "oom"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "tests/oom_on_rank1.py", *RUN, f"logging.run_dir={run_dir}", "trainer.micro_batch_size=8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("out of memory; retrying with trainer.micro_batch_size=4") == 1
    assert (run_dir / "rollouts.jsonl").read_bytes() == (single / "rollouts.jsonl").read_bytes()
    for p, q in zip(lora(single, 3)[0], lora(run_dir, 3)[0]):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_code_env_and_expert_counters_add_up_over_processes(tmp_path):
    """The code env with expert_edits (reference expert): its counters (expert calls, sandbox runs)
    logged by a 2-process run equal the single-process run's, evaluation included."""
    code = ["model=tiny", "external=expert_edits", "logging.progress=false", "logging.wandb.mode=disabled",
            "trainer.steps=2", "trainer.batch_size=3", "trainer.num_generations=2", "generation.max_new_tokens=24",
            "eval.max_problems=3", "eval.num_samples=2", "eval.every=1"]
    dirs = {}
    for procs in (1, 2):
        dirs[procs] = tmp_path / f"code{procs}"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
            if procs > 1 else [sys.executable]
        proc = subprocess.run([*launcher, "train.py", *code, f"logging.run_dir={dirs[procs]}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr.count("offline reference expert") == 1  # one start-up line, not one per process
    one, two = metrics(dirs[1]), metrics(dirs[2])
    assert one[-1]["expert/calls"] > 0 and one[-1]["eval/expert/calls"] > 0  # evaluation's own (issue 45)
    for a, b in zip(one, two):
        for key in a:
            if key.startswith(("expert/", "env/", "eval/expert/")) and not key.endswith("expert/latency_s"):
                assert b[key] == a[key], (a["step"], key)
