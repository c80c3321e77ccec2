"""A trained run on disk, for inference (generation, the ``stream`` protocol): where its weights are, its
config and labels, its vocabulary, and prompts in its tokens.

A run directory (written by ``python -m experiments.run``) holds ``config.yaml``, ``metrics.json`` and
``checkpoints/step_<N>/model.safetensors`` (canonical weights, any backend). One written by a backend's
``train(cfg, run_dir)`` called from Python has no ``config.yaml``; its config is the one each checkpoint
records (``loop_state.json``). :func:`locate_run` accepts the run directory, one of its checkpoint
directories or a weights file inside it, and fails with one line that says what to pass instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors

from pcaf_core import run_identity
from pcaf_core.checkpoints import CHECKPOINT_DIR, LOOP_STATE_FILE, latest_checkpoint, read_loop_state, step_of
from pcaf_core.config import DataConfig, RunConfig
from pcaf_core.config_io import config_from_dict, read_config
from pcaf_core.params import param_shapes
from pcaf_core.results import CONFIG_FILE, SchemaError, read_metrics
from pcaf_core.weights import load_canonical

WEIGHTS_FILE = "model.safetensors"  # the canonical weights of a checkpoint, written by either backend
EOS = "<eos>"


class RunNotFoundError(FileNotFoundError):
    """No usable trained run at the given path; the message says what to pass."""


class VocabularyMismatchError(ValueError):
    """Weights and vocabulary do not belong together."""


@dataclass
class TrainedRun:
    """A run's config, its chosen weights file and its labels (table, row, scale, backend, profile, seed)."""

    run_dir: Path
    config: RunConfig
    weights: Path
    step: int | None
    labels: dict[str, Any]
    vocab_sha256: str | None = None  # of the vocabulary it trained on, where its record says (metrics.json)

    def describe(self) -> str:
        """One label for every line a tool prints about this run."""
        lab = self.labels
        step = "?" if self.step is None else self.step
        return (f"{lab.get('table', '?')}/{lab.get('row', '?')} scale={lab.get('scale', '?')} "
                f"trained-backend={lab.get('backend', '?')} profile={self.config.profile.name} "
                f"seed={self.config.train.seed} step={step}")


def _run_dir_of(path: Path) -> Path:
    """The run directory holding ``path``: itself or its nearest ancestor with a config.yaml, else with a
    ``checkpoints/`` folder (a run trained by a backend's ``train`` from Python writes no config.yaml)."""
    candidates = (path, *path.parents)
    for marker, is_there in ((CONFIG_FILE, Path.is_file), (CHECKPOINT_DIR, Path.is_dir)):
        for candidate in candidates:
            if is_there(candidate / marker):
                return candidate
    raise RunNotFoundError(f"{path} is not inside a run directory (no {CONFIG_FILE} or {CHECKPOINT_DIR}/ found "
                           "above it): pass run_dir=<a directory written by python -m experiments.run or by a "
                           "backend's train()>")


def _run_config(run_dir: Path, weights: Path) -> RunConfig:
    """The run's ``config.yaml``, else the config the checkpoint holding ``weights`` recorded."""
    if (run_dir / CONFIG_FILE).is_file():
        return read_config(run_dir / CONFIG_FILE)
    if (weights.parent / LOOP_STATE_FILE).is_file():
        recorded = read_loop_state(weights.parent).config
        if recorded:
            return config_from_dict(recorded)
    raise RunNotFoundError(f"run {run_dir} has no {CONFIG_FILE}, and {weights.parent} records no config (no "
                           f"{LOOP_STATE_FILE}): pass a run directory or one of its checkpoints/step_<N> directories")


def locate_run(path: str | Path, checkpoint: str | Path | None = None) -> TrainedRun:
    """The run at ``path`` (run directory, checkpoint directory or weights file) and its weights: those of
    ``checkpoint`` when given (a checkpoint directory or a weights file), else ``path``'s own, else the
    run's newest complete checkpoint."""
    path = Path(path)
    if not path.exists():
        raise RunNotFoundError(f"no run at {path}: pass run_dir=<a directory written by python -m experiments.run>")
    run_dir = _run_dir_of(path if path.is_dir() else path.parent)
    chosen = Path(checkpoint) if checkpoint is not None else (path if path != run_dir else None)
    if chosen is None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise RunNotFoundError(f"run {run_dir} has no complete checkpoint (did it finish? see its metrics.json)")
        chosen = ckpt
    weights = chosen / WEIGHTS_FILE if chosen.is_dir() else chosen
    if not weights.is_file():
        raise RunNotFoundError(f"no weights file {weights}: pass a run directory, a checkpoints/step_<N> directory "
                               f"or a {WEIGHTS_FILE}")
    labels: dict[str, Any] = {}
    vocab_sha256 = None
    try:
        m = read_metrics(run_dir)
        labels = {"table": m.table, "row": m.row, "scale": m.scale, "backend": m.backend, "status": m.status}
        vocab_sha256 = ((m.extra or {}).get("data") or {}).get("vocab_sha256")
    except (FileNotFoundError, SchemaError):
        pass
    return TrainedRun(run_dir, _run_config(run_dir, weights), weights, step_of(weights.parent), labels,
                      vocab_sha256)


def weights_vocab_size(weights: Path) -> int:
    """Rows of ``embed.weight`` in a weights file (read from its header, no tensor loaded)."""
    with safetensors.safe_open(str(weights), framework="numpy") as fh:
        if "embed.weight" not in fh.keys():
            raise VocabularyMismatchError(f"{weights} has no embed.weight: it is not a PCAF-suite checkpoint")
        return int(fh.get_slice("embed.weight").get_shape()[0])


def load_params(run: TrainedRun) -> dict[str, np.ndarray]:
    """The canonical parameters of ``run``'s weights, checked against its config's shapes. A checkpoint with
    another vocabulary size fails with :class:`VocabularyMismatchError` before any shape error."""
    cfg = run.config
    rows = weights_vocab_size(run.weights)
    if rows != cfg.model.vocab_size:
        raise VocabularyMismatchError(
            f"{run.weights} was trained with a vocabulary of {rows} ids, run {run.run_dir} with model.vocab_size="
            f"{cfg.model.vocab_size}: the checkpoint belongs to another run; pass that run's run_dir")
    return load_canonical(run.weights, param_shapes(cfg.model, cfg.memory, cfg.profile))


LOCATION_FIELDS = tuple(f.partition(".")[2] for f in run_identity.LOCATION_FIELDS)


def run_data_config(run: TrainedRun, locations: dict[str, str | None] | None = None) -> DataConfig:
    """The run's data settings, with only where the corpus and its cache live changeable (``data_dir``,
    ``cache_dir``): any other change would give other token ids than the weights were trained on."""
    locations = locations or {}
    bad = sorted(set(locations) - set(LOCATION_FIELDS))
    if bad:
        raise VocabularyMismatchError(
            f"data.{bad[0]} cannot be changed: the run's token ids come from its own data settings (only "
            f"{', '.join('data.' + f for f in LOCATION_FIELDS)} may be given)")
    return dataclasses.replace(run.config.data, **locations)


def load_vocabulary(run: TrainedRun, data: DataConfig | None = None) -> tuple[Any, str]:
    """The run's vocabulary (from its corpus cache, built on first use) and its tokenizer name.

    Raises :class:`VocabularyMismatchError` when the vocabulary has more ids than the weights' embedding, or is
    not the one the run's record says it trained on (another corpus in ``data.data_dir``, say).
    """
    from pcaf_core.data import load_corpus, resolve_settings

    data = data or run.config.data
    corpus = load_corpus(data)
    V = run.config.model.vocab_size
    if len(corpus.vocab) > V:
        raise VocabularyMismatchError(
            f"the vocabulary of data={data.name} (max_vocab={data.max_vocab}) has {len(corpus.vocab)} ids, the "
            f"checkpoint's embedding {V}: it was trained on another vocabulary")
    if run.vocab_sha256 and corpus.vocab.sha256 != run.vocab_sha256:
        raise VocabularyMismatchError(
            f"the vocabulary of {corpus.record()['source']} (sha256 {corpus.vocab.sha256[:12]}) is not the one run "
            f"{run.run_dir} trained on ({run.vocab_sha256[:12]}): point data.data_dir at the corpus it trained on")
    return corpus.vocab, resolve_settings(data).tokenizer


def encode_prompt(vocab: Any, text: str, tokenizer: str) -> tuple[np.ndarray, list[str]]:
    """Prompt text -> ``[n]`` int64 ids in the run's tokenization, and the words it reads as ``<unk>``
    (callers warn about them). An empty prompt raises ValueError."""
    from pcaf_core.data.tokenizer import SPECIALS, get_tokenizer

    words = get_tokenizer(tokenizer)(text)
    if not words:
        raise ValueError("the prompt has no tokens: give prompt=\"some words\"")
    unknown = [w for w in words if w not in vocab.stoi and w not in SPECIALS]
    return vocab.encode_tokens(words).astype(np.int64), unknown


def detokenize(vocab: Any, ids: np.ndarray) -> str:
    """Ids -> text: tokens joined by spaces, ``<eos>`` as a line break (the WikiText releases' convention)."""
    words = vocab.decode(np.asarray(ids).reshape(-1))
    return " ".join(words).replace(f" {EOS} ", "\n").replace(f" {EOS}", "\n").replace(f"{EOS} ", "\n")
