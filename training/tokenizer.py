#!/usr/bin/env python3
"""Step 2: a byte-level BPE tokenizer with 8,192 entries trained on train.txt.

Pre-tokenization is Qwen's split pattern followed by ByteLevel; special tokens
are <|endoftext|> (id 0, end of document) and <|mask|> (id 1, the DFlash mask).
Writes tokenizer.json and tokenizer_config.json (with a ChatML-style template
that the serving API can use; this is a completion model).

Usage: tokenizer.py --corpus DIR --out DIR
"""
import argparse
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def documents(path, chunk=1 << 20):
    with open(path, encoding="utf-8") as f:
        buf = ""
        while True:
            block = f.read(chunk)
            if not block:
                break
            buf += block
            parts = buf.split("<|endoftext|>")
            buf = parts.pop()
            yield from parts
        if buf:
            yield buf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, min_frequency=2, special_tokens=["<|endoftext|>", "<|mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents(os.path.join(a.corpus, "train.txt")), trainer)
    os.makedirs(a.out, exist_ok=True)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
           "pad_token": "<|endoftext|>", "mask_token": "<|mask|>", "model_max_length": 2048,
           "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print(json.dumps({"vocab": tok.get_vocab_size(), "eot": tok.token_to_id("<|endoftext|>"),
                      "mask": tok.token_to_id("<|mask|>")}), flush=True)


if __name__ == "__main__":
    main()
