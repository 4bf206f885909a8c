#!/usr/bin/env python3
"""Trains two small byte-level BPE tokenizers with Hugging Face `tokenizers`
that use the components the Qwen3 tokenizer does not: an NFKC normalizer,
ignore_merges, a TemplateProcessing BOS, Split behaviours other than Isolated,
ByteLevel with add_prefix_space and its own regex, and added tokens with
lstrip / rstrip / single_word / normalized set.

Usage: make_test_tokenizers.py --corpus corpus.jsonl --out DIR
"""
import argparse
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train(texts, tok, special):
    trainer = trainers.BpeTrainer(vocab_size=3000, min_frequency=2, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)


def llama3_style(texts):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    train(texts, tok, ["<|begin_of_text|>", "<|eot_id|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False)])
    tok.add_tokens([AddedToken("[word]", single_word=True, normalized=False),
                    AddedToken("ﬁx", normalized=True),
                    AddedToken("<sep>", rstrip=True, normalized=False),
                    AddedToken("hello", single_word=True, normalized=True)])
    return tok


def gpt2_style(texts):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFC()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="contiguous"),
        pre_tokenizers.Split(" ", behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"[.,;]"), behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"\n+"), behavior="removed", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    train(texts, tok, ["<|endoftext|>"])
    tok.add_special_tokens([AddedToken("<|user|>", lstrip=True, rstrip=True, normalized=False)])
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    texts = [json.loads(line) for line in open(a.corpus, encoding="utf-8")]
    for name, make in (("llama3_style", llama3_style), ("gpt2_style", gpt2_style)):
        d = os.path.join(a.out, name)
        os.makedirs(d, exist_ok=True)
        make(texts).save(os.path.join(d, "tokenizer.json"))
        print(name, os.path.getsize(os.path.join(d, "tokenizer.json")), "bytes")


if __name__ == "__main__":
    main()
