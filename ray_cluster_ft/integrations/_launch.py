"""What went wrong when the processes running a plan are not the plan's ranks: the launcher's own variables say
how many processes it started, so the message can name the real cause (a CPU Trainer without ``use_cpu=True``,
no launcher at all, a launcher asked for another count) instead of repeating the command the user ran."""

from __future__ import annotations

import os


def _launcher() -> str:
    """The launcher that started this process, from the variables it sets."""
    if any(k.startswith("ACCELERATE_") for k in os.environ):
        return "accelerate launch"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "the launcher"


def _launch_commands(n: int) -> str:
    return (f"torchrun --nproc_per_node {n} script.py, or accelerate launch --num_processes {n} script.py "
            f"(on CPUs: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes {n} script.py)")


def world_size_message(planned: int, running: int, what: str, use_cpu: bool | None = None) -> str:
    """The error text for a plan of ``planned`` ranks run by ``running`` processes.

    Args:
        planned: the plan's world size (``max(rank) + 1``).
        running: the world size the caller sees (``TrainingArguments.world_size``, ``dist.get_world_size()``).
        what: who sees ``running``, e.g. ``"this Trainer"`` or ``"world_size"``.
        use_cpu: a Trainer's ``args.use_cpu`` (``None`` for a plain loop): on a machine without CUDA
            ``TrainingArguments`` joins the launched processes into one run only with ``use_cpu=True``; without
            it every process is a separate 1-process run (verified with transformers 5 and torchrun on 2 CPUs).

    Returns:
        One message: the mismatch, its cause where the environment shows it (``WORLD_SIZE`` of torchrun or
        Accelerate), and what to do.
    """
    head = f"the plan is for {planned} ranks but {what} runs {running} process{'es' if running != 1 else ''}"
    env = os.environ.get("WORLD_SIZE")
    started = int(env) if env and env.isdigit() else None
    if started is not None and started != running:
        cause = f"{_launcher()} started {started} processes, but {what} runs {running}"
        if use_cpu is False and running == 1 and not _cuda():
            return (f"{head}: {cause} on CPU without use_cpu=True (without CUDA, TrainingArguments joins the "
                    f"launched processes only with use_cpu=True; each process here is a separate 1-process run); "
                    f"pass TrainingArguments(..., use_cpu=True)")
        return f"{head}: {cause}; check that every process joins one process group (init_process_group)"
    if started is not None:  # the launcher started what the caller sees: the count asked for is wrong
        return (f"{head}: {_launcher()} was asked for {started}; launch {planned} ({_launch_commands(planned)}) or "
                f"re-plan for {started} (train.num_workers: {started})")
    if running == 1:
        return (f"{head}: this is a single process started without a launcher (no WORLD_SIZE); launch "
                f"{planned}: {_launch_commands(planned)}")
    return f"{head}; launch {planned} ({_launch_commands(planned)}) or re-plan for {running}"


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())
