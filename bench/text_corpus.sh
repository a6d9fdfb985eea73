#!/usr/bin/env bash
# A real-text corpus from Debian's documentation packages, tokenized for training:
# the reStructuredText sources of Python's documentation (python3.11-doc), Perl's
# POD manuals (perl-doc), Git's manuals (git-doc) and the Debian Reference
# (debian-reference-en), about 25 MB of English technical prose and code.
#
#   bench/text_corpus.sh DIR [VOCAB]     (VOCAB default 8192)
#
# Missing packages are installed with apt-get when it is there and we are root;
# whichever of the four sources exist are used (at least one must). Writes:
#   DIR/docs.list      the documents, one path a line, in a fixed shuffled order
#                      (sorted by a hash of the path, so validation mixes sources)
#   DIR/tok.json       `longmoe tokenizer train --vocab VOCAB` on all of them
#   DIR/shards/        `longmoe data prepare` (2% validation): train with
#                      --data shards:DIR/shards (configs/text-gpu.json reads data/text/shards)
# LONGMOE names the program (default build/longmoe). Nothing is downloaded at run
# time by longmoe itself: this script is the one place the text comes from.
set -euo pipefail
DIR=${1:?usage: bench/text_corpus.sh DIR [VOCAB]}
VOCAB=${2:-8192}
LONGMOE=${LONGMOE:-build/longmoe}
[ -x "$LONGMOE" ] || { echo "text_corpus: $LONGMOE is not built (make build)" >&2; exit 1; }
[ -e "$DIR/shards" ] && { echo "text_corpus: $DIR/shards exists: remove it or choose another DIR" >&2; exit 1; }
mkdir -p "$DIR/text"

pkgs=(python3.11-doc perl-doc git-doc debian-reference-en)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing ${missing[*]}"
    apt-get install -y -q "${missing[@]}" >"$DIR/apt.log" 2>&1 || echo "apt-get failed (see $DIR/apt.log): using what is there"
fi

{
    [ -d /usr/share/doc/python3.11/html/_sources ] && find /usr/share/doc/python3.11/html/_sources -name '*.txt'
    find /usr/share/perl -name '*.pod' 2>/dev/null || true
    [ -d /usr/share/doc/git ] && find /usr/share/doc/git -name '*.txt'
    if [ -f /usr/share/debian-reference/debian-reference.en.txt.gz ]; then
        zcat /usr/share/debian-reference/debian-reference.en.txt.gz >"$DIR/text/debian-reference.txt"
        echo "$DIR/text/debian-reference.txt"
    fi
} | while read -r f; do [ -s "$f" ] && printf '%s %s\n' "$(printf '%s' "${f#"$DIR"/}" | cksum | cut -d' ' -f1)" "$f"; done |
    sort -n | cut -d' ' -f2- >"$DIR/docs.list"
n=$(wc -l <"$DIR/docs.list")
[ "$n" -gt 0 ] || { echo "text_corpus: none of ${pkgs[*]} is installed" >&2; exit 1; }
bytes=$(tr '\n' '\0' <"$DIR/docs.list" | du -cb --files0-from=- | tail -1 | cut -f1)
echo "$n documents, $bytes bytes"
mapfile -t docs <"$DIR/docs.list"
"$LONGMOE" tokenizer train --input "${docs[@]}" --vocab "$VOCAB" --out "$DIR/tok.json"
"$LONGMOE" data prepare --input "${docs[@]}" --tokenizer "$DIR/tok.json" --out "$DIR/shards" --val-fraction 0.02
