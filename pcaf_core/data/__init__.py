"""The data layer: real corpora -> cached token ids -> training and evaluation windows.

NumPy and the standard library only (never torch or jax), so both backends share it.

Typical use by a trainer::

    from pcaf_core.data import load_corpus, WindowSampler, FullEvalWindows, check_token_ids

    corpus = load_corpus(cfg.data)                       # builds the cache on first use
    check_token_ids(corpus.train, cfg.model.vocab_size)  # ids < V, or a clear error
    train = WindowSampler(corpus.train, T, B, mode, seed=cfg.train.train_sample_seed)
    inputs, targets = train.next_batch()                 # [B, T] int32, [B] or [B, T] int32
    for batch in FullEvalWindows(corpus.eval, T, B, mode):  # the `full` protocol
        ...

Command line: ``python -m pcaf_core.data summary data=wikitext2`` (see docs/DATA.md).
"""

from .cache import (
    Budgets,
    CorpusSettings,
    TokenizedCorpus,
    build_cache,
    load_corpus,
    read_manifest,
    resolve_settings,
)
from .corpora import (
    CORPORA,
    ENV_CACHE_DIR,
    ENV_DATA_DIR,
    SPLITS,
    Source,
    cache_root,
    data_search_dirs,
    locate_source,
)
from .errors import DataError, DataNotFoundError
from .samplers import EvalBatch, FullEvalWindows, WindowSampler
from .tokenizer import (
    EOS_ID,
    PAD_ID,
    SPECIALS,
    TOKEN_PATTERN,
    UNK_ID,
    Vocabulary,
    build_vocab,
    check_token_ids,
    regex_tokenize,
    whitespace_tokenize,
)
from .verify import verify_source

__all__ = [
    "CORPORA", "ENV_CACHE_DIR", "ENV_DATA_DIR", "EOS_ID", "PAD_ID", "SPECIALS", "SPLITS", "TOKEN_PATTERN",
    "UNK_ID", "Budgets", "CorpusSettings", "DataError", "DataNotFoundError", "EvalBatch", "FullEvalWindows",
    "Source", "TokenizedCorpus", "Vocabulary", "WindowSampler", "build_cache", "build_vocab", "cache_root",
    "check_token_ids", "data_search_dirs", "load_corpus", "locate_source", "read_manifest", "regex_tokenize",
    "resolve_settings", "verify_source", "whitespace_tokenize",
]
