"""The world-size errors name the real cause (integrations/_launch.py): the launcher's WORLD_SIZE against what
the Trainer or loop sees; the torchrun-on-CPU-without-use_cpu case is the one transformers 5 shows (each of
torchrun's 2 processes gets TrainingArguments.world_size 1 unless use_cpu=True)."""

from __future__ import annotations

import pytest

from ray_cluster_ft.integrations._launch import world_size_message


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("ACCELERATE_") or k in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(k)
    return monkeypatch


def test_torchrun_on_cpu_without_use_cpu_is_named(clean_env):
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setattr("torch.cuda.is_available", lambda: False)
    msg = world_size_message(2, 1, "this Trainer", use_cpu=False)
    assert msg.startswith("the plan is for 2 ranks but this Trainer runs 1 process: torchrun started 2 processes, "
                          "but this Trainer runs 1 on CPU without use_cpu=True")
    assert msg.endswith("pass TrainingArguments(..., use_cpu=True)")
    # With use_cpu=True (or on CUDA) the cause is elsewhere: the processes did not join one group.
    assert "use_cpu" not in world_size_message(2, 1, "this Trainer", use_cpu=True)
    clean_env.setenv("ACCELERATE_USE_CPU", "false")
    assert "accelerate launch started 2 processes" in world_size_message(2, 1, "this Trainer", use_cpu=False)


def test_a_launcher_asked_for_another_count_is_told_both_ways_out(clean_env):
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    msg = world_size_message(2, 4, "this job")
    assert msg == ("the plan is for 2 ranks but this job runs 4 processes: torchrun was asked for 4; launch 2 "
                   "(torchrun --nproc_per_node 2 script.py, or accelerate launch --num_processes 2 script.py (on "
                   "CPUs: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 script.py)) or "
                   "re-plan for 4 (train.num_workers: 4)")


def test_no_launcher_at_all(clean_env):
    msg = world_size_message(2, 1, "this job")
    assert "a single process started without a launcher (no WORLD_SIZE); launch 2: torchrun --nproc_per_node 2" in msg
    assert world_size_message(3, 2, "this job").startswith("the plan is for 3 ranks but this job runs 2 processes; "
                                                            "launch 3 (")
