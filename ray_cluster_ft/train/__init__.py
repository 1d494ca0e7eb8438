"""Training stage: Ray Train launches DeepSpeed workers that train exactly the micro-batches of the plan.

The driver joins the allocation plan with the tokenized examples and builds one Ray dataset per rank (rows in
plan order, :mod:`.rank_data`); ``DataConfig(datasets_to_split=[])`` with ``preserve_order=True`` hands rank
``r`` the dataset ``train_rank{r}`` unsplit and in order, so every rank trains the rows the plan assigned to it
at the planned step (docs/design.md, "Train"). Each worker (:mod:`.loop`) loads the model, wraps it with
``deepspeed.initialize`` (ZeRO 0-3; fp32 + gloo on CPU, bf16 + NCCL on GPU) with the DeepSpeed dict the driver
built once (:mod:`.deepspeed`), and runs the step of :mod:`.step` per micro-batch.

Artifacts written under ``run_dir``:

- ``trained/rank{r}.jsonl`` and, after the run, ``trained.parquet``: one row per trained example
  (rank, step, micro_index, epoch, example_id), in training order; the driver checks it equals the plan.
- ``train_log.jsonl``: one row per optimizer step (loss averaged over ranks, tokens, timings, lr).
- ``ray_train/train/``: Ray Train's run folder with the final DeepSpeed checkpoint (all ranks' shards).
- ``final_model/``: the trained model in Hugging Face format plus the tokenizer (``save_model=True``).
"""

from .._lazy import lazy_exports

# Imported on first use (PEP 562): `ray-cluster-ft check` builds the DeepSpeed config without importing Ray.
_WHERE = {
    "build_deepspeed_config": "deepspeed",
    "TrainOutput": "driver",
    "TrainResult": "driver",
    "run": "driver",
    "train": "driver",
    "verify_trained": "driver",
    "build_rank_tables": "rank_data",
    "micro_batch_to_device": "step",
}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
