#!/usr/bin/env python3
"""Builds the tokenizer parity corpus: one JSON string per line, at least
20,000 strings and 5 MB. Deterministic for a given input tree.

Sources: this repository's own code and docs; the MIT/Apache benchmark prompt
sets given with --prompts (gsm8k, humaneval, math500, mt-bench); and generated
text: words in 30 scripts (letters and marks picked from the Unicode database),
emoji with ZWJ/skin-tone/flag/keycap sequences, combining-mark stacks and
decomposed text (NFC changes it), whitespace and newline runs, digit runs,
special-token strings inside text, control and format characters, and random
splices of all of these.

Usage: make_tokenizer_corpus.py --repo . --prompts DIR --out corpus.jsonl
"""
import argparse
import json
import os
import random
import unicodedata

SCRIPTS = {  # name: code point ranges holding its letters and marks
    "latin": [(0x41, 0x5A), (0x61, 0x7A), (0xC0, 0x24F), (0x1E00, 0x1EFF)],
    "greek": [(0x391, 0x3C9), (0x1F00, 0x1FFF)], "cyrillic": [(0x400, 0x4FF)], "armenian": [(0x531, 0x587)],
    "hebrew": [(0x591, 0x5F4)], "arabic": [(0x600, 0x6FF), (0x750, 0x77F)], "syriac": [(0x710, 0x74A)],
    "thaana": [(0x780, 0x7B1)], "devanagari": [(0x900, 0x97F)], "bengali": [(0x980, 0x9FE)],
    "gurmukhi": [(0xA00, 0xA76)], "gujarati": [(0xA81, 0xAFF)], "tamil": [(0xB82, 0xBFA)],
    "telugu": [(0xC00, 0xC7F)], "kannada": [(0xC80, 0xCF2)], "malayalam": [(0xD00, 0xD7F)],
    "sinhala": [(0xD81, 0xDF4)], "thai": [(0xE01, 0xE5B)], "lao": [(0xE81, 0xEDF)], "tibetan": [(0xF00, 0xFDA)],
    "myanmar": [(0x1000, 0x109F)], "georgian": [(0x10A0, 0x10FF)], "ethiopic": [(0x1200, 0x137C)],
    "khmer": [(0x1780, 0x17F9)], "mongolian": [(0x1820, 0x1878)], "hangul": [(0xAC00, 0xD7A3)],
    "hiragana": [(0x3041, 0x309F)], "katakana": [(0x30A0, 0x30FF)], "cjk": [(0x4E00, 0x9FFF)],
    "cjk_ext_b": [(0x20000, 0x2A6DF)],
}
PUNCT = ".,;:!?()[]{}\"'-–—…«»“”‘’¿¡、。，．・「」『』《》،؛؟।॥"
EMOJI = ["😀", "😂", "🥲", "🤷", "👍", "🙏", "🔥", "✨", "🚀", "❤️", "☺️", "🫠", "🧑‍💻", "👩‍❤️‍👨", "👨‍👩‍👧‍👦",
         "🏳️‍🌈", "🏴‍☠️", "🇫🇷", "🇯🇵", "🇺🇸", "#️⃣", "1️⃣", "🏴\U000E0067\U000E0062\U000E0065\U000E006E\U000E0067\U000E007F",
         "👋🏻", "👋🏿", "🤷🏽‍♀️", "🧔🏾‍♂️", "🐈‍⬛", "©️", "™", "🀄", "🃏"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
           "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
           "</tool_response>", "<think>", "</think>", "<|im_", "<|endoftext", "<|", "|>", "<think", "< think>"]
SPACES = [" ", "  ", "    ", "\t", "\n", "\r\n", "\n\n", "\n\n\n", " \n", "\t\t", "\u00A0", "\u3000", "\u2028",
          "\u2029", "\u200B", "\u180E", "\u0085", "\uFEFF", "\u2003", "\u202F", "\x0b", "\x0c", "\r", " \t \n "]
CONTROLS = [chr(c) for c in range(0x00, 0x20)] + ["\x7f"] + [chr(c) for c in range(0x80, 0xA0)] + [
    "\u200C", "\u200D", "\u200E", "\u200F", "\u202A", "\u202B", "\u202C", "\u202D", "\u202E", "\u2066", "\u2067",
    "\u2068", "\u2069", "\u00AD", "\uFFFD", "\uFFFE", "\uFFFF", "\uE000", "\U0010FFFD", "\U000E0001"]
COMBINING = [chr(c) for c in range(0x300, 0x370)] + ["\u20DD", "\u20E3", "\u1AB0", "\u1DC0", "\uFE20"]


def letters(ranges):
    out = []
    for a, b in ranges:
        for c in range(a, b + 1):
            cat = unicodedata.category(chr(c))
            if cat[0] in "LM" or (cat == "Nd"):
                out.append(chr(c))
    return out


class Gen:
    def __init__(self, seed):
        self.r = random.Random(seed)
        self.alpha = {k: letters(v) for k, v in SCRIPTS.items()}

    def word(self, script):
        a = self.alpha[script]
        n = self.r.choice([1, 2, 3, 4, 5, 6, 8, 12]) if script not in ("cjk", "cjk_ext_b") else self.r.randint(1, 4)
        return "".join(self.r.choice(a) for _ in range(n))

    def sentence(self, script):
        r = self.r
        sep = "" if script in ("cjk", "hiragana", "katakana", "thai", "lao", "cjk_ext_b") and r.random() < 0.7 else " "
        words = [self.word(script) for _ in range(r.randint(2, 14))]
        s = sep.join(words)
        if r.random() < 0.5:
            s += r.choice(PUNCT)
        if r.random() < 0.2:
            s = s.capitalize()
        return s

    def number(self):
        r = self.r
        kind = r.randint(0, 6)
        if kind == 0:
            return str(r.randint(0, 10 ** r.randint(1, 30)))
        if kind == 1:
            return f"{r.uniform(-1e6, 1e6):.{r.randint(0, 8)}f}"
        if kind == 2:
            return f"{r.randint(0, 999)},{r.randint(0, 999):03d},{r.randint(0, 999):03d}"
        if kind == 3:  # non-ASCII digits: Arabic-Indic, Devanagari, fullwidth, Thai
            base = r.choice([0x660, 0x966, 0xFF10, 0xE50, 0x6F0, 0x9E6])
            return "".join(chr(base + r.randint(0, 9)) for _ in range(r.randint(1, 12)))
        if kind == 4:
            return f"{r.randint(1, 12)}/{r.randint(1, 31)}/{r.randint(1900, 2100)}"
        if kind == 5:
            return f"0x{r.getrandbits(r.choice([8, 32, 64])):x}"
        return f"{r.random():e}"

    def emoji_run(self):
        r = self.r
        return r.choice(["", " "]).join(r.choice(EMOJI) for _ in range(r.randint(1, 6)))

    def zalgo(self):
        r = self.r
        base = self.word(r.choice(["latin", "greek", "cyrillic"]))
        return "".join(ch + "".join(r.choice(COMBINING) for _ in range(r.randint(0, 4))) for ch in base)

    def decomposed(self):
        s = self.sentence(self.r.choice(["latin", "greek", "cyrillic", "hangul", "devanagari"]))
        return unicodedata.normalize(self.r.choice(["NFD", "NFKD", "NFD"]), s)

    def whitespace(self):
        r = self.r
        parts = []
        for _ in range(r.randint(1, 8)):
            parts.append(r.choice(SPACES) * r.randint(1, 5))
            if r.random() < 0.6:
                parts.append(self.word(r.choice(["latin", "cjk", "arabic"])))
        return "".join(parts)

    def specials(self):
        r = self.r
        parts = []
        for _ in range(r.randint(1, 6)):
            parts.append(r.choice(SPECIAL))
            parts.append(r.choice(["", " ", "\n", "x", "user\n", self.word("latin"), "你好", "  "]))
        return "".join(parts)

    def controls(self):
        r = self.r
        return "".join(r.choice(CONTROLS) if r.random() < 0.5 else self.word("latin") for _ in range(r.randint(1, 10)))

    def code_like(self):
        r = self.r
        ident = lambda: "_".join(self.word("latin").lower() for _ in range(r.randint(1, 3)))
        lines = []
        ind = 0
        for _ in range(r.randint(2, 20)):
            kind = r.randint(0, 5)
            pad = " " * ind if r.random() < 0.8 else "\t" * (ind // 4)
            if kind == 0:
                lines.append(f"{pad}def {ident()}({ident()}, {ident()}={self.number()}):")
                ind += 4
            elif kind == 1:
                lines.append(f"{pad}{ident()} = [{', '.join(self.number() for _ in range(r.randint(0, 5)))}]")
            elif kind == 2:
                lines.append(f"{pad}if {ident()} >= {self.number()} and not {ident()}: return {ident()}[::-1]")
            elif kind == 3:
                lines.append(f"{pad}# {self.sentence(r.choice(list(SCRIPTS)))}")
            elif kind == 4:
                lines.append(f"{pad}std::vector<{ident()}> {ident()}{{{self.number()}}}; // {self.sentence('latin')}")
            else:
                ind = max(0, ind - 4)
                lines.append("")
        return "\n".join(lines) + r.choice(["", "\n", "\n\n"])

    def mixed(self, pool):
        r = self.r
        return "".join(r.choice(pool)[: r.randint(1, 300)] for _ in range(r.randint(2, 8)))


def repo_texts(repo, r):
    out = []
    for top in ("src", "tests", "tools", "scripts"):
        for root, dirs, files in os.walk(os.path.join(repo, top)):
            dirs[:] = sorted(d for d in dirs if d != "fixtures")
            for f in sorted(files):
                if not f.endswith((".cpp", ".h", ".py", ".sh", ".txt", ".md", ".jinja", ".cu", ".cuh")):
                    continue
                text = open(os.path.join(root, f), encoding="utf-8").read()
                i = 0
                while i < len(text):
                    n = r.randint(50, 3000)
                    out.append(text[i:i + n])
                    i += n
    for f in ("README.md", "CMakeLists.txt"):
        p = os.path.join(repo, f)
        if os.path.exists(p):
            out.append(open(p, encoding="utf-8").read())
    return out


def prompt_texts(prompts_dir):
    out = []
    for name in ("gsm8k.jsonl", "humaneval.jsonl", "math500.jsonl", "mt-bench.jsonl"):
        for line in open(os.path.join(prompts_dir, name), encoding="utf-8"):
            row = json.loads(line)
            out.extend(row["turns"])
            if isinstance(row.get("answer"), str):
                out.append(row["answer"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default=".")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--generated", type=int, default=16000, help="number of generated strings")
    a = ap.parse_args()
    g = Gen(a.seed)
    texts = repo_texts(a.repo, g.r) + prompt_texts(a.prompts)
    makers = [lambda: g.sentence(g.r.choice(list(SCRIPTS))) + " " + g.sentence(g.r.choice(list(SCRIPTS))),
              lambda: "\n".join(g.sentence(g.r.choice(list(SCRIPTS))) for _ in range(g.r.randint(2, 12))),
              g.number, g.emoji_run, g.zalgo, g.decomposed, g.whitespace, g.specials, g.controls, g.code_like]
    generated = []
    for i in range(a.generated):
        generated.append(makers[i % len(makers)]())
    pool = texts + generated
    for _ in range(a.generated // 4):
        generated.append(g.mixed(pool))
    generated += ["", " ", "\n", "a", "  \n\n  ", "<|im_start|>", "'s 'S 'T 'Re 'vE 'll 'd ſ", "ǅ ǆ Ǆ İ ı ß ẞ"]
    corpus = texts + generated
    with open(a.out, "w", encoding="utf-8") as f:
        for t in corpus:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    total = sum(len(t.encode("utf-8")) for t in corpus)
    print(f"{len(corpus)} strings, {total / 1e6:.2f} MB of UTF-8")


if __name__ == "__main__":
    main()
