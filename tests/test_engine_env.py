"""The environment a vLLM engine starts with under torchrun (magrpo.backends.vllm.engine_env): pure
functions, no vllm needed."""
from __future__ import annotations

import os

import torch

from magrpo.backends.vllm import engine_env, patched_environ

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0", "OMP_NUM_THREADS": "1", "HOME": "/h"}
CPU = torch.device("cpu")


def test_one_process_changes_nothing():
    assert engine_env({"HOME": "/h"}, CPU, [0, 1]) == {}
    assert engine_env({"WORLD_SIZE": "1", "RANK": "0"}, torch.device("cuda", 0), [0, 1]) == {}


def test_under_torchrun_the_engine_sees_no_torchrun_variables_and_binds_to_its_ranks_cores():
    changes = engine_env(TORCHRUN, CPU, [3, 0, 1, 2])
    removed = {k for k, v in changes.items() if v is None}
    assert removed == {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                       "TORCHELASTIC_RUN_ID", "GROUP_RANK"}
    assert changes["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"  # local rank 1 of 2: the second half of the cores
    assert engine_env({**TORCHRUN, "LOCAL_RANK": "0"}, CPU, [0, 1, 2, 3])["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"


def test_more_ranks_than_cores_share_cores_and_a_users_binding_is_kept():
    ranks = {r: engine_env({**TORCHRUN, "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3"}, CPU, [0, 1]) for r in range(3)}
    assert [ranks[r]["VLLM_CPU_OMP_THREADS_BIND"] for r in range(3)] == ["0", "1", "0"]
    users = engine_env({**TORCHRUN, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, CPU, [0, 1])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in users


def test_on_cuda_the_engine_sees_only_the_trainers_gpu():
    assert engine_env(TORCHRUN, torch.device("cuda", 1), [0])["CUDA_VISIBLE_DEVICES"] == "1"
    # CUDA_VISIBLE_DEVICES renumbers devices: cuda:1 is the second visible one
    visible = engine_env({**TORCHRUN, "CUDA_VISIBLE_DEVICES": "4,6"}, torch.device("cuda", 1), [0])
    assert visible["CUDA_VISIBLE_DEVICES"] == "6"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(TORCHRUN, torch.device("cuda", 0), [0])


def test_patched_environ_restores_what_it_changed(monkeypatch):
    monkeypatch.setenv("MAGRPO_TEST_KEEP", "a")
    monkeypatch.delenv("MAGRPO_TEST_NEW", raising=False)
    with patched_environ({"MAGRPO_TEST_KEEP": None, "MAGRPO_TEST_NEW": "b"}):
        assert "MAGRPO_TEST_KEEP" not in os.environ and os.environ["MAGRPO_TEST_NEW"] == "b"
    assert os.environ["MAGRPO_TEST_KEEP"] == "a" and "MAGRPO_TEST_NEW" not in os.environ
