"""Configuration: the user's `PredictConfig` (YAML), the server's `ServerSettings` (`blockspec serve` flags) and the
target architecture read from config.json."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import BlockspecError
from .files import read_json

SUPPORTED_MODEL_TYPES = {"qwen3_5", "qwen3_5_text"}
# The most tokens one target pass verifies (anchor + proposals, or a draft tree's root + nodes): the pending buffers
# of a partial or path commit and the kernels' row limits are sized by it.
MAX_PASS_TOKENS = 64
MAX_CONFIG_SIZE, MAX_CONFIG_LAYERS = 1 << 20, 1024  # a config.json's sizes and layer counts past these are refused
MAX_BODY_MB = 1024  # the largest request body `serve` may be told to take, in MB
MAX_CONFIG_BYTES = 1 << 20  # a YAML config file larger than this is refused unread
MAX_VERIFY_TOKENS = 16  # the longest chain pass (anchor + proposals), whose partial commit the buffers hold
# Draft-tree budget where none is set, by device (docs/benchmarks.md, "The default budget"): on a GPU a tree of 31
# draft nodes, the best measured against the chain with the bf16 and the INT4 27B (a 32-row pass costs little more
# than an 8-row one where the weights' stream bounds it); on the CPU a tree of 15, whose 16 rows cost what the chain's
# 8 do there, where each row past them costs ~0.4 ms.
DEFAULT_TREE_BUDGETS = {"cuda": 31, "cpu": 15}
# A tree's lookup branch (`tree_lookup`): 7 of its nodes where the budget leaves the drafter its chain. On the demo
# pair it adds 15-18 % to the tokens per cycle of one cycle from standard-library code at budgets 15 and 31
# (docs/benchmarks.md, "Draft trees").
DEFAULT_TREE_LOOKUP = 7
SUPPORTED_ARCHITECTURES = {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"}


class CheckedSettings(BaseModel):
    """Settings whose build() refuses a bad value in one line naming its key."""

    @classmethod
    def build(cls, data: dict, source: str = "config"):
        try:
            return cls(**data)
        except ValidationError as exc:
            raise BlockspecError(f"{source}: {describe_validation_error(exc)}") from None


# The sampling settings' ranges, shared by PredictConfig and the per-request SamplingSettings.
MAX_TEMPERATURE = 100.0  # past it a distribution is uniform in all but name
# A positive temperature below this decodes greedily: the float32 logits divided by it would overflow to inf (NaN
# probabilities), and long before that the softmax is one-hot at the argmax anyway (vLLM uses the same 1e-5).
MIN_TEMPERATURE = 1e-5
MAX_SEED = 2 ** 63 - 1   # what torch's generators take


def device_type(device: str) -> str:
    """The kind of device a `device` setting runs on: auto is cuda where a CUDA GPU is available."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _tiny_is_greedy(temperature: float) -> float:
    return 0.0 if temperature < MIN_TEMPERATURE else temperature


Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False),
                        AfterValidator(_tiny_is_greedy)]            # 0 (or below MIN_TEMPERATURE): greedy
TopK = Annotated[int, Field(ge=0, le=2 ** 63 - 1)]                  # 0, or past the vocabulary: no limit
TopP = Annotated[float, Field(gt=0.0, le=1.0)]                      # 1: no limit
MinP = Annotated[float, Field(ge=0.0, le=1.0)]                      # 0: no limit
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed")


class SamplingSettings(CheckedSettings):
    """How a request chooses its tokens. Temperature 0 is greedy (the filters then play no part); above 0 each token
    is drawn from the target's float32 logits processed in the order vLLM and transformers use: temperature, then
    top-k (the k most likely tokens, ties with the k-th kept), top-p (the most likely tokens until their probability
    reaches top_p), min-p (tokens at least min_p times as likely as the most likely one). Temperature is at most
    MAX_TEMPERATURE; one below MIN_TEMPERATURE is taken as 0 (greedy). A top_k past the vocabulary keeps every token.
    seed: 0..MAX_SEED; None: fresh randomness for each request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Temperature = 0.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    min_p: MinP = 0.0
    seed: Seed | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class PredictConfig(CheckedSettings):
    """Everything a run needs besides the prompt. Unknown keys are refused (typos must not pass silently).
    No environment variable changes any of these: a setting lives here or nowhere."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = None
    mode: Literal["none", "mtp", "dflash2"] | None = None  # None: dflash2 when dflash2_model is set, else none
    batch_size: int = Field(1, ge=1)
    beam_size: int = Field(1, ge=1)
    temperature: Temperature = 0.0  # sampling (SamplingSettings); each request may override these five
    top_k: TopK = 0
    top_p: TopP = 1.0
    min_p: MinP = 0.0
    seed: Seed | None = None
    compute_dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = "bfloat16"
    device: Literal["cpu", "cuda", "auto"] = "auto"
    gpu_ranks: list[int] = Field(default_factory=lambda: [0])
    context_length: int = Field(4096, ge=2)
    prefill_chunk_size: int = Field(2048, ge=1)
    # keep the last request's state; a prompt that starts with its tokens prefills only the rest (engine/reuse.py)
    prefix_reuse: bool = True
    prefix_snapshots: int = Field(4, ge=1, le=64)  # state snapshots kept for it, allocated at load
    max_tokens: int = Field(256, ge=1)
    self_speculative_num_tokens: int = Field(3, ge=1, le=MAX_VERIFY_TOKENS - 1)
    draft_vocabulary: int | str = 0  # 0: proposals over the full head; N or a JSON file of ids: layers/draft_head
    dflash2_model: str | None = None
    dflash2_quantization: Literal["none", "int8"] = "none"
    # draft nodes a DFlash2 cycle verifies as a tree in one target pass (layers/tree.py): the greedy chain, then the
    # drafter's most likely other continuations, best first; 0: the chain alone; None: DEFAULT_TREE_BUDGETS in mode
    # dflash2 (`tree_budget`)
    dflash2_tree_budget: int | None = Field(None, ge=0, le=MAX_PASS_TOKENS - 1)
    # what orders the tree's nodes: the selector's transition model (a candidate given the pick before it), or each
    # row's marginal distribution (the drafter's logits alone)
    dflash2_tree_scores: Literal["transition", "marginal"] = "transition"
    # of the tree's nodes, the last this many hold a branch copied from the context (layers/tree.py, ContextLookup):
    # the tokens that followed the latest earlier occurrence of its last tokens; at most the drafter's proposals, and
    # the budget keeps room for the chain; 0: the drafter's nodes alone; None: DEFAULT_TREE_LOOKUP where it fits
    dflash2_tree_lookup: int | None = Field(None, ge=0, le=15)
    # the DFlash2 drafter's blocks at inference: this many rows (block - 1 proposals), at most the block it was
    # trained with (None: its own); a drafter trained on longer blocks may accept more per row at a shorter one
    dflash2_block_size: int | None = Field(None, ge=2, le=16)
    target_quantization: Literal["none", "int4", "fp8"] = "none"  # a quantized checkpoint sets it (as stored)
    vocabulary_quantization: Literal["none", "int8", "int4"] = "none"
    # Projections that share an input are always packed at load (layers/linear.py): these two keys stay accepted
    # (recipes set them) and read true; false is noted on stderr, not honoured.
    fuse_kvq: bool = True
    fuse_gate: bool = True
    # 0: the step recorded as CUDA graphs (the default; the CPU always runs eagerly); -1: eager (debugging, --eager)
    compile_mode: Literal[-1, 0] = 0
    fold_norms: bool = True  # INT4 / FP8 target on CUDA: norms and SwiGLU in the W4A16 launches (layers/folded_norm.py)
    # programmatic dependent launch (kernels/pdl.py), 0 (off) to 3; None: what the target's weights measured best
    # with (3 for an INT4 or FP8 target, 0 for bf16: docs/benchmarks.md)
    pdl_level: int | None = Field(None, ge=0, le=3)
    pdl_prefetch_mb: float = Field(4.0, ge=0)  # weight bytes each projection prefetches into L2 while it waits
    # an INT4 target's folded MLP (gate_up, SwiGLU, down, the next norm begun) as one warp-specialized launch at
    # 1..8 rows on Hopper (kernels/quant_matmul_gluon.py `launch_mlp`); off until it measures faster than two
    persistent_mlp: bool = False
    # a bar over the checkpoint's shards (GB/s) on stderr while a large checkpoint loads, with tqdm installed
    # (blockspec/progress.py): the command line shows it; the Python API stays quiet unless this is set
    load_progress: bool = False

    @field_validator("draft_vocabulary")
    @classmethod
    def _draft_vocabulary(cls, value: int | str) -> int | str:
        if (isinstance(value, int) and value < 0) or value == "":
            raise ValueError("give 0 (the full head), a number of token ids, or a JSON file of ids")
        return value

    @field_validator("model", "dflash2_model")
    @classmethod
    def _a_path(cls, value: str | None) -> str | None:
        if value == "":  # else read as no drafter (mode none) or the current folder
            raise ValueError("is empty: give a checkpoint folder")
        return value

    @field_validator("gpu_ranks")
    @classmethod
    def _one_gpu(cls, ranks: list[int]) -> list[int]:
        if len(ranks) != 1 or ranks[0] < 0:
            raise ValueError("blockspec runs on exactly one GPU: give one non-negative rank, e.g. [0]")
        return ranks

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[self.compute_dtype]

    @property
    def sampling(self) -> SamplingSettings:
        return SamplingSettings(**{key: getattr(self, key) for key in SAMPLING_KEYS})

    @property
    def tree_budget(self) -> int:
        """The tree budget of this config's DFlash2 cycles: as set, else its device's DEFAULT_TREE_BUDGETS; 0 in the
        other modes."""
        if self.dflash2_tree_budget is not None:
            return self.dflash2_tree_budget
        return DEFAULT_TREE_BUDGETS[device_type(self.device)] if self.decode_mode == "dflash2" else 0

    def tree_lookup(self, proposals: int) -> int:
        """The lookup branch's nodes in this config's trees, for a drafter of `proposals` proposals a block: as set,
        else DEFAULT_TREE_LOOKUP, cut to the proposals and to what the tree budget leaves beyond the chain."""
        if self.dflash2_tree_lookup is not None:
            return self.dflash2_tree_lookup
        return max(0, min(DEFAULT_TREE_LOOKUP, proposals, self.tree_budget - proposals))

    @property
    def decode_mode(self) -> str:
        if self.mode is not None:
            return self.mode
        return "dflash2" if self.dflash2_model else "none"

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "PredictConfig":
        """The config in a YAML file, overrides (typed values, e.g. the command line's flags) on top. The file's
        values are taken as written: a duplicate key, a key that is not a setting's name, a string for a number or
        a flag, true / false for a number: each refused in one line naming the file, the key and its line."""
        path = Path(path)
        if path.exists() and not path.is_file():  # a device (/dev/zero) or a pipe would be read without end
            raise BlockspecError(f"config file {path}: not a regular file")
        try:
            if path.stat().st_size > MAX_CONFIG_BYTES:
                raise BlockspecError(f"config file {path}: larger than {MAX_CONFIG_BYTES >> 20} MB; a config is a "
                                     "few lines of YAML")
            data, lines = _load_yaml(path.read_bytes().decode("utf-8-sig"))
        except OSError as exc:
            raise BlockspecError(f"config file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise BlockspecError(f"config file {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                                 f"{exc.start})") from None
        except _DuplicateKey as exc:
            raise BlockspecError(f"config file {path}: {exc}") from None
        except RecursionError:
            raise BlockspecError(f"config file {path}: not valid YAML (nested too deeply)") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise BlockspecError(f"config file {path}: not valid YAML ({problem}{where})") from None
        data = {} if data is None else data  # an empty file (or one of comments): the defaults
        if not isinstance(data, dict):
            raise BlockspecError(f"config file {path}: expected a mapping of keys to values (got "
                                 f"{'a list' if isinstance(data, list) else repr(data)})")

        def where(key) -> str:  # the file, and the key's line where it is written (not merged from elsewhere)
            return f"{path} line {lines[key]}" if key in lines else str(path)
        for key, value in data.items():
            if not isinstance(key, str):
                raise BlockspecError(f"config file {path}: config key {key!r} is not a setting's name")
            spec = cls.model_fields.get(key)  # an unknown key is refused below
            if isinstance(value, bool) and spec is not None and spec.annotation is not bool:
                # strict validation still takes false for compile_mode's 0
                raise BlockspecError(f"{where(key)}: invalid value for '{key}': Input should not be true or false "
                                     f"(got {value!r})")
        try:  # the file's values strictly (no '1' for 1, no 'no' for false), the typed overrides as usual
            cls.model_validate(data, strict=True)
        except ValidationError as exc:
            raise BlockspecError(f"{where(exc.errors()[0]['loc'][0])}: {describe_validation_error(exc)}") from None
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.build(data, source=str(path))


def unused_settings(config: PredictConfig) -> list[str]:
    """'KEY: VALUE does nothing: WHY' for each key given by name (a file's, a flag's: model_fields_set) that this run
    never reads, for a note on stderr; a default, given or not, is never named. A value asking for what the run
    cannot do (e.g. dflash2_quantization int8 outside mode dflash2) is refused instead, when the engine loads
    (engine/load.py)."""
    mode, cpu = config.decode_mode, config.device == "cpu" and "device is 'cpu'"
    not_dflash2 = mode != "dflash2" and f"mode is {mode!r}"
    why = {
        "self_speculative_num_tokens": mode != "mtp" and f"mode is {mode!r}",  # DFlash2's: the drafter's blocks
        "draft_vocabulary": mode == "none" and "mode is 'none'",
        "dflash2_tree_budget": not_dflash2,
        "dflash2_tree_scores": not_dflash2 or (config.tree_budget == 0 and "dflash2_tree_budget is 0 (no tree)"),
        # 0 does nothing there; any other value is refused at load
        "dflash2_tree_lookup": not_dflash2 or (config.tree_budget == 0 and "dflash2_tree_budget is 0 (no tree)"),
        "dflash2_block_size": not_dflash2,
        "dflash2_quantization": not_dflash2,
        "prefix_snapshots": not config.prefix_reuse and "prefix_reuse is false",
        "gpu_ranks": cpu,
        "pdl_level": cpu,  # device auto may be a GPU: only a CPU named is known to launch no PDL kernel
        "pdl_prefetch_mb": cpu or (config.pdl_level == 0 and "pdl_level is 0"),
        "persistent_mlp": cpu or (not config.fold_norms and "fold_norms is false"),
        "compile_mode": cpu and config.compile_mode == -1 and "the CPU always runs eagerly",
    }
    return [f"{key}: {getattr(config, key)!r} does nothing: {reason}" for key, reason in why.items()
            if reason and key in config.model_fields_set
            and getattr(config, key) != PredictConfig.model_fields[key].get_default(call_default_factory=True)]


def unused_sampling(config: PredictConfig) -> list[str]:
    """unused_settings' note on the sampling keys given (not at their defaults) at temperature 0, where every token
    is the most likely one, for a run whose tokens all follow the config (generate, chat); none for serve, whose
    requests may raise the temperature and then use them."""
    given = [f"{key}: {getattr(config, key)!r}" for key in SAMPLING_KEYS if key != "temperature"
             and key in config.model_fields_set
             and getattr(config, key) != PredictConfig.model_fields[key].get_default(call_default_factory=True)]
    if not given or not config.sampling.greedy:
        return []
    return [f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} nothing: temperature is 0 (greedy "
            "decoding); set temperature above 0 to sample"]


def _load_yaml(text: str) -> tuple[object, dict[str, int]]:
    """The document (_ConfigLoader's) and the line (from 1) of each key of its top-level mapping."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()
    lines = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                lines.setdefault(key_node.value, key_node.start_mark.line + 1)
    return data, lines


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, first_line: int, line: int):
        super().__init__(f"key {key!r} is given twice (line {first_line}, then line {line})")


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in a mapping (PyYAML keeps the last) and reads numbers in decimal:
    010 is ten (not PyYAML's octal eight), 1:30 a string (not its base-60 ninety), 0x10 and 0b110 strings (refused
    where a number is wanted), 1_000 a thousand, 1e-3 a number (the YAML 1.1 rules make it the string '1e-3')."""

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *anchor' merges a mapping; the keys after it override the merged ones
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if (type(key), key) in lines:
                    raise _DuplicateKey(key, lines[type(key), key], line)
                lines[type(key), key] = line
            except TypeError:
                pass  # an unhashable key: SafeLoader refuses it
        return super().construct_mapping(node, deep=deep)


_YAML_INT, _YAML_FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_YAML_INT, _YAML_FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_ConfigLoader.add_implicit_resolver(_YAML_INT, re.compile(r"^[-+]?[0-9][0-9_]*$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    _YAML_FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
                            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
_ConfigLoader.add_constructor(_YAML_INT, lambda loader, node: int(loader.construct_scalar(node).replace("_", "")))


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming the first offending key and why it was refused."""
    err = exc.errors()[0]
    # the key and its list indices, not the union member tried ('draft_vocabulary.int')
    key = ".".join(str(p) for i, p in enumerate(err["loc"]) if i == 0 or isinstance(p, int)) or "value"
    if err["type"] == "extra_forbidden":
        return f"unknown config key '{key}'"
    message = "Input should be true or false" if err["type"] in ("bool_type", "bool_parsing") else err["msg"]
    return f"invalid value for '{key}': {message} (got {err.get('input')!r})"


@dataclass(frozen=True)
class ServerSettings:
    """`blockspec serve`'s settings: where it listens, how many requests may wait, the limits on what a request may
    carry and how long it may take, shutdown, and who may call it. Each is a flag (none is read from the
    environment); check() refuses a bad value in one line naming the flag."""

    host: str = "127.0.0.1"
    port: int = 8000
    queue_size: int = 8                 # requests that may wait for the engine besides the running one (more: 429)
    max_body_mb: float = 4.0            # a larger request body is refused (413) before it is read
    receive_timeout_s: float = 30.0     # to send the request headers (else the connection closes), then the body (408)
    shutdown_grace_s: float = 10.0      # on SIGTERM, how long the running request may go on before it is stopped
    allowed_hosts: tuple[str, ...] = ()     # Host header names accepted besides loopback ones and host ('*': any)
    allowed_origins: tuple[str, ...] = ()   # web page origins allowed to call the server ('*': any)
    api_key: str | None = None          # when set, /v1 requests need 'Authorization: Bearer <api_key>'
    max_connections: int = 256          # open at once; past it the longest idle one closes (all busy: 503)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def check(self):
        if not 0 <= self.port <= 65535:
            raise BlockspecError(f"--port must be between 0 and 65535 (got {self.port})")
        if self.queue_size < 0:
            raise BlockspecError(f"--queue-size must be 0 or more (got {self.queue_size})")
        for flag, value in (("--max-body-mb", self.max_body_mb), ("--receive-timeout", self.receive_timeout_s)):
            if not (math.isfinite(value) and value > 0):
                raise BlockspecError(f"{flag} must be a number above 0 (got {value:g})")
        if self.max_body_mb > MAX_BODY_MB:
            raise BlockspecError(f"--max-body-mb must be at most {MAX_BODY_MB} (got {self.max_body_mb:g})")
        if not (math.isfinite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0):
            raise BlockspecError(f"--shutdown-grace must be 0 or more seconds (got {self.shutdown_grace_s:g})")
        for name in self.allowed_hosts:
            head, _, port = name.rpartition(":")
            if port.isdigit() and (head.endswith("]") or (head and ":" not in head)):  # not an IPv6 address's colons
                raise BlockspecError(f"--allowed-hosts: '{name}' has a port, but the Host header is checked by name "
                                     f"only, on any port: write '{head}'")
        for origin in self.allowed_origins:
            if origin not in ("*", "null") and "://" not in origin:
                raise BlockspecError(f"--allowed-origins: '{origin}' is not an origin (scheme://host[:port], e.g. "
                                     "http://localhost:3000, or *)")
        if self.api_key is not None and not self.api_key.strip():
            raise BlockspecError("--api-key must not be empty")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()
                                             and self.api_key == self.api_key.strip()):
            # headers arrive as Latin-1 bytes, and clients send a key's other characters as UTF-8
            raise BlockspecError("--api-key must be printable ASCII without leading or trailing spaces")
        if self.max_connections < 1:
            raise BlockspecError(f"--max-connections must be at least 1 (got {self.max_connections})")


@dataclass(frozen=True)
class TargetConfig:
    """The target architecture, read from a Hugging Face config.json (text part only)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    max_position_embeddings: int = 262144

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_file(cls, path: Path) -> "TargetConfig":
        if not Path(path).exists():
            raise BlockspecError(f"{path}: file not found (is this a Hugging Face checkpoint directory?)")
        return cls.from_dict(read_json(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "TargetConfig":
        """Every field the model uses checked here, so that a bad value is refused in one line naming its key
        before any weight is read (not met later as a shape error or a silently wrong model)."""
        if not isinstance(raw, dict):
            raise BlockspecError(f"{source}: the top level must be a JSON object (got {type(raw).__name__})")
        archs = raw.get("architectures") or []
        if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
            raise BlockspecError(f"{source}: config key 'architectures' must be a list of names (got {archs!r})")
        archs = set(archs)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES or (archs and not archs & SUPPORTED_ARCHITECTURES):
            got = ", ".join(sorted(archs)) or model_type
            raise BlockspecError(
                f"{source}: unsupported architecture {got!r} (model_type {model_type!r}); blockspec supports "
                "Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration (model_type qwen3_5, qwen3_5_text)")
        text = raw.get("text_config", raw) if model_type == "qwen3_5" else raw
        if not isinstance(text, dict):
            raise BlockspecError(f"{source}: config key 'text_config' must be an object (got {text!r})")

        def fail(key, problem):
            raise BlockspecError(f"{source}: config key '{key}' {problem}")

        def need(key, default=None):
            if key in text and text[key] is not None:
                return text[key]
            if default is not None:
                return default
            raise BlockspecError(f"{source}: missing config key '{key}'")

        def integer(key, value, minimum=1, maximum=MAX_CONFIG_SIZE):
            # JSON writers may store a whole number as 4096.0; 8192.7 or "8" is refused, never truncated or parsed;
            # sizes far past any model's are refused before the memory estimate builds the model's shapes
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
                fail(key, f"must be an integer from {minimum} to {maximum} (got {value!r})")
            return value

        def positive(key, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                fail(key, f"must be a finite number above 0 (got {value!r})")
            return float(value)

        rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
        rope = text.get(rope_key) or {}
        if not isinstance(rope, dict):
            fail(rope_key, f"must be an object (got {rope!r})")
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            key = "rope_type" if "rope_type" in rope else "type"  # transformers' older configs say 'type'
            raise BlockspecError(f"{source}: {rope_key}.{key} {rope[key]!r} is not supported "
                                 "(only 'default')")

        layers = integer("num_hidden_layers", need("num_hidden_layers"), maximum=MAX_CONFIG_LAYERS)
        interval = integer("full_attention_interval", text.get("full_attention_interval", 4))
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if not isinstance(layer_types, (list, tuple)):
            fail("layer_types", f"must be a list (got {layer_types!r})")
        bad = [t for t in layer_types if t not in ("full_attention", "linear_attention")]
        if len(layer_types) != layers or bad:
            raise BlockspecError(f"{source}: layer_types must list {layers} entries of 'full_attention' / "
                                 f"'linear_attention' (got {len(layer_types)} entries, unknown: {bad[:3]})")
        heads = integer("num_attention_heads", need("num_attention_heads"))
        hidden = integer("hidden_size", need("hidden_size"))
        vocab = integer("vocab_size", need("vocab_size"))
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        for token in eos:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                fail("eos_token_id", f"must be token ids below vocab_size {vocab} (got {token!r})")
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        if not isinstance(tie, bool):
            fail("tie_word_embeddings", f"must be true or false (got {tie!r})")
        factor_key = f"{rope_key}.partial_rotary_factor" if "partial_rotary_factor" in rope else "partial_rotary_factor"
        factor = positive(factor_key, rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        if factor > 1:
            fail(factor_key, f"must be at most 1 (got {factor:g})")
        cfg = cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size", need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=integer("num_key_value_heads", need("num_key_value_heads")),
            head_dim=integer("head_dim", hidden // heads if text.get("head_dim") is None else text["head_dim"]),
            layer_types=tuple(layer_types),
            linear_num_key_heads=integer("linear_num_key_heads", need("linear_num_key_heads", 16)),
            linear_num_value_heads=integer("linear_num_value_heads", need("linear_num_value_heads", 32)),
            linear_key_head_dim=integer("linear_key_head_dim", need("linear_key_head_dim", 128)),
            linear_value_head_dim=integer("linear_value_head_dim", need("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=integer("linear_conv_kernel_dim", need("linear_conv_kernel_dim", 4)),
            rms_norm_eps=positive("rms_norm_eps", text.get("rms_norm_eps", 1e-6)),
            rope_theta=positive(f"{rope_key}.rope_theta" if "rope_theta" in rope else "rope_theta",
                                rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
            partial_rotary_factor=factor,
            tie_word_embeddings=tie,
            mtp_num_hidden_layers=integer("mtp_num_hidden_layers", text.get("mtp_num_hidden_layers") or 0, 0,
                                          MAX_CONFIG_LAYERS),
            eos_token_ids=eos,
            max_position_embeddings=integer("max_position_embeddings", text.get("max_position_embeddings", 262144),
                                            2, 1 << 62),  # the memory estimate bounds the context
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise BlockspecError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                                 f"{cfg.num_key_value_heads}")
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise BlockspecError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
        # the rotate-half rotary embedding pairs channel j with j + rotary_dim / 2
        if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
            fail(factor_key, f"{factor:g} gives {cfg.rotary_dim} rotary channels of head_dim {cfg.head_dim}: they "
                 "must be even and at least 2")
        return cfg
