#!/usr/bin/env python3
"""Interop check of longmoe's tokenizer file with Hugging Face `tokenizers`.

usage: check_tokenizer.py TOK.json TEXT IDS [TEXT IDS ...]

TEXT is a UTF-8 file; IDS holds the ids longmoe's encoder gave it
(whitespace-separated). The check passes when Tokenizer.from_file(TOK.json)
encodes every TEXT to exactly IDS and decodes IDS back to TEXT. Exit status 0
on success, 1 on a mismatch (the first differing position is printed)."""
import sys

from tokenizers import Tokenizer


def main(argv):
    if len(argv) < 4 or len(argv) % 2 != 0:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    tok = Tokenizer.from_file(argv[1])
    failures = 0
    total = 0
    for text_path, ids_path in zip(argv[2::2], argv[3::2]):
        with open(text_path, "rb") as f:
            text = f.read().decode("utf-8")
        with open(ids_path) as f:
            want = [int(x) for x in f.read().split()]
        got = tok.encode(text, add_special_tokens=False).ids
        total += len(want)
        if got != want:
            i = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
            print(f"{text_path}: ids differ at position {i} of {len(want)} (longmoe) / {len(got)} (tokenizers): "
                  f"longmoe {want[i:i + 5]} tokenizers {got[i:i + 5]}")
            failures += 1
            continue
        back = tok.decode(want, skip_special_tokens=False)
        if back != text:
            print(f"{text_path}: tokenizers' decode of the ids differs from the text")
            failures += 1
    print(f"tokenizers {__import__('tokenizers').__version__}: {len(argv) // 2 - 1} texts, {total} ids, "
          f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
