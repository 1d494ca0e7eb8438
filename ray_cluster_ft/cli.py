"""ray-cluster-ft command line: run a job spec, resume a stopped run, run the demo, check a spec, export the
selected rows, prefetch features into the feature store."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from pathlib import Path

__all__ = ["main", "demo_config_path"]


def demo_config_path() -> Path:
    """The built-in demo job spec (also at ``jobs/demo.yaml`` in the repository)."""
    return Path(__file__).with_name("configs") / "demo.yaml"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ray-cluster-ft", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job spec (YAML)")
    run.add_argument("config", nargs="?", help="job spec, e.g. jobs/demo.yaml (omit with --resume)")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a stopped run from its last checkpoint, with the job spec saved in RUN_DIR")
    run.add_argument("--output", help="run directory (overrides output.dir)")
    run.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS or a new local Ray)")
    run.add_argument("--plan-only", action="store_true",
                     help="stop after the allocation plan: data, sketches, clusters, selection and plan only")
    sel = sub.add_parser("select", help="data, features, clusters, selection and plan (as run --plan-only), then "
                                        "the selected rows as they were read: selected.jsonl, selected.parquet")
    sel.add_argument("config", help="job spec (YAML)")
    sel.add_argument("--output", help="run directory (overrides output.dir)")
    sel.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS or a new local Ray)")
    sel.add_argument("--format", choices=["llamafactory", "axolotl"], dest="export_format",
                     help="also write the selection for that trainer: llamafactory/ (selected.jsonl and a "
                          "dataset_info.json entry) or axolotl/ (a chat_template dataset); the plan's order and "
                          "weights are not used there")
    feat = sub.add_parser("features", help="data and features only, into the feature store (sketch.store): a "
                                            "nightly job prefetches what later runs read")
    feat.add_argument("config", help="job spec (YAML) with sketch.store set")
    feat.add_argument("--output", help="run directory (overrides output.dir)")
    feat.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS or a new local Ray)")
    demo = sub.add_parser("demo", help="run the built-in demo (SmolLM2-135M on HumanEval + MMLU medical)")
    demo.add_argument("--output", help="run directory (default runs/demo)")
    demo.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS or a new local Ray)")
    check = sub.add_parser("check", help="validate a job spec and print it with defaults filled in (stdout); read "
                                         "the data with the tokenizer only: files, formats, row counts, unused "
                                         "fields and two decoded examples (stderr)")
    check.add_argument("config", help="job spec (YAML) to validate")
    return p


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the run stops where it is (its finished artifacts and checkpoints stay)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """SIGINT (Ctrl-C) and SIGTERM (``ray job stop``, Kubernetes, schedulers) raise :class:`Interrupted` in the
    main thread for the duration of a run, so both stop it the same way: workers stopped, one line, exit
    ``128 + signal`` (130, 143).

    A handler's exception can land where Python cannot raise it (a ``__del__``, a weakref callback, an import's
    clean-up) and is then only reported as "Exception ignored": the run would go on as if no signal had come.
    Such an :class:`Interrupted` is delivered again 50 ms later from a timer thread (``_thread.interrupt_main``;
    at once, the handler would raise inside the hook, ignored again), unless another one has been raised since
    (the run is already stopping: its clean-up must not be cut short) or the run is over (the caller's own
    handler must not get it)."""
    import _thread

    state = {"active": True, "raised": 0}
    lock = threading.Lock()

    def again(signum: int, raised: int) -> None:
        with lock:
            if state["active"] and state["raised"] == raised:
                _thread.interrupt_main(signum)

    def later(signum: int) -> None:
        timer = threading.Timer(0.05, again, args=(signum, state["raised"]))
        timer.daemon = True
        timer.start()

    def raise_interrupted(signum, frame):
        while frame is not None:  # inside the hook below an exception would be lost for good
            if frame.f_code is redeliver.__code__:
                return later(signum)
            frame = frame.f_back
        state["raised"] += 1
        raise Interrupted(signum)

    def redeliver(unraisable):
        if isinstance(unraisable.exc_value, Interrupted):
            later(unraisable.exc_value.signum)
        else:
            hook(unraisable)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hook, old = sys.unraisablehook, {}
    try:
        sys.unraisablehook = redeliver
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, raise_interrupted)
        yield
    finally:
        with lock:
            state["active"] = False
        sys.unraisablehook = hook
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for a config error, 130 after SIGINT, 143 after SIGTERM)."""
    from .config import ConfigError, load_config

    args = _parser().parse_args(argv)
    run_dir = None
    try:
        if args.command == "check":
            cfg = load_config(args.config)
            if cfg.train.deepspeed_config:
                from .train import build_deepspeed_config

                build_deepspeed_config(cfg.train)
            from .data import check

            check(cfg, out=sys.stderr)  # stdout stays the spec as JSON
            print(json.dumps(cfg.model_dump(mode="json"), indent=2))
            return 0
        resume = getattr(args, "resume", None)
        if resume:
            if args.config or args.output:
                raise ConfigError("--resume RUN_DIR takes the job spec and output directory saved in RUN_DIR; "
                                  "drop CONFIG and --output")
            path = Path(resume) / "config.yaml"
            if not Path(resume).is_dir():
                raise ConfigError(f"--resume {resume}: " + ("a file, not a run directory" if Path(resume).exists()
                                                             else "no such directory"))
            if not path.is_file():
                raise ConfigError(f"--resume {resume}: no config.yaml there (not a ray-cluster-ft run directory)")
            overrides = {"output.dir": str(Path(resume).resolve())}
        else:
            path = demo_config_path() if args.command == "demo" else args.config
            if path is None:
                raise ConfigError("run needs a job spec (CONFIG) or --resume RUN_DIR")
            overrides = {"output.dir": args.output} if args.output else {}
        cfg = load_config(path, overrides)
        run_dir = Path(cfg.output.dir).expanduser().resolve()
        from .pipeline import run_features, run_pipeline

        if args.command == "features":
            with _stop_on_signals():
                manifest = run_features(cfg, address=args.address)
            c, sk = manifest["counts"], manifest["sketch"]
            print(f"[ray-cluster-ft] features: {c['candidates']} candidates, {c['features_computed']} computed, "
                  f"{c['features_reused']} reused; store {sk['store']} (key {sk['feature_key']}); "
                  f"total {manifest['timings_s']['total']:.0f} s")
            return 0
        selecting = args.command == "select"
        with _stop_on_signals():
            manifest = run_pipeline(cfg, address=args.address,
                                    plan_only=selecting or getattr(args, "plan_only", False), resume=bool(resume))
            if selecting:
                from .api import write_selected

                selected = write_selected(cfg, run_dir, args.export_format)
    except (ConfigError, FileNotFoundError) as err:
        print(f"ray-cluster-ft: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # the recipe shut Ray down (workers stopped); no traceback
        signum = getattr(err, "signum", signal.SIGINT)
        where = f"`ray-cluster-ft run --resume {run_dir}`" if run_dir else "`ray-cluster-ft run --resume RUN_DIR`"
        if args.command in ("select", "features"):  # the same command again (shards and stored rows are kept)
            where = f"`ray-cluster-ft {args.command} {args.config} --output {run_dir}`"
        print(f"ray-cluster-ft: interrupted ({signal.Signals(signum).name}); continue the run with {where}",
              file=sys.stderr)
        return 128 + signum
    c, t = manifest["counts"], manifest["timings_s"]
    print(f"[ray-cluster-ft] done: read {c['read']}, rejected {c['rejected']}, selected {c['selected']}, "
          f"trained {c['trained']}; total {t['total']:.0f} s")
    ev = manifest.get("eval", {})
    if ev.get("before") and ev.get("after"):
        b, a = ev["before"]["all"]["loss"], ev["after"]["all"]["loss"]
        print(f"[ray-cluster-ft] held-out loss {b:.4f} -> {a:.4f}")
    print(f"[ray-cluster-ft] report: {Path(manifest['run_dir']) / 'report.md'}")
    if selecting:
        print(f"[ray-cluster-ft] selected rows: {selected[0]} and {selected[1]} (with cluster, weight, example_id, "
              f"and the rank and step of each row's first planned appearance)")
        if len(selected) > 2:
            print(f"[ray-cluster-ft] for {args.export_format}: {' and '.join(str(p) for p in selected[2:])} (the "
                  f"plan's order and weights are not used there; docs/library.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
