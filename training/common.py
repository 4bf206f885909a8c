"""Shared helpers of the training pipeline: corpus tokenization and the
transformers-version-neutral RoPE arguments."""
import inspect
import os

import numpy as np
from tokenizers import Tokenizer

EOT = "<|endoftext|>"


def rope_kwargs(config_cls, theta):
    """transformers 5 takes rope_parameters; 4.x takes rope_theta."""
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def tokenize_file(tokenizer_dir, path, cache):
    """All documents of a corpus file as one uint16 id stream, each followed by EOT."""
    if os.path.exists(cache):
        return np.load(cache)
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    docs = open(path, encoding="utf-8").read().split(EOT)
    docs = [d for d in docs if d]
    ids = []
    for i in range(0, len(docs), 4096):
        for enc in tok.encode_batch(docs[i:i + 4096], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(cache, arr)
    return arr
