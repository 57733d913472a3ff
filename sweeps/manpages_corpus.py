"""A second corpus, for checking a change adopted on the built-in corpus on text no tuning used: the
English manual pages (sections 1-8, troff markup stripped) and the plain-text package
documentation (README, NEWS, *.txt, *.md, *.rst; gzipped ones unpacked) installed on a Debian
machine. Left out: Perl's pages and documentation (the Perl library is kept aside as a further
independent check), Python's (the built-in corpus is CPython's), changelogs, and licence files
(the same licence text in hundreds of packages would sit on both sides of the split).

    python sweeps/manpages_corpus.py --out /tmp/manpages.jsonl
    python data.py prepare --input /tmp/manpages.jsonl --out data/manpages --vocab-size 1024 --val-fraction 0.02
    python train.py --config configs/cpu.yaml data.source=shards data.path=data/manpages \
        data.tokenizer=data/manpages/tokenizer.model

What is installed differs between machines: data.py's corpus fingerprint (the ledger's data_sha)
says which text a run saw. Documents are written in sorted path order, one JSON line each.
"""

import argparse
import gzip
import json
import re
from pathlib import Path

MAN_SECTIONS = [Path(f"/usr/share/man/man{n}") for n in range(1, 9)]
DOC_ROOT = Path("/usr/share/doc")
# Perl: kept aside; python: the built-in corpus's own language; changelogs: release notes by the
# hundred, not prose.
SKIP = ("perl", "python", "changelog")
DOC_NAMES = re.compile(r"^(README|NEWS)([._-].*)?$|\.(txt|md|rst)(\.gz)?$", re.IGNORECASE)

# troff: font and size changes, named characters and strings, and zero-width escapes carry no text.
ESCAPES = [(re.compile(p), r) for p, r in [
    (r'\\".*', ""),                                   # comment to the end of the line
    (r"\\f(\[[^\]]*\]|\(..|.)", ""),                  # font change
    (r"\\s[+-]?\d+", ""),                             # size change
    (r"\\\*(\[[^\]]*\]|\(..|.)", ""),                 # defined string
    (r"\\\((em|en)", "-"), (r"\\\(..", " "),          # named characters
    (r"\\[&|^%:c]", ""),                              # zero-width
    (r"\\(.)", lambda m: "\\" if m.group(1) == "e" else m.group(1)),  # \e is a backslash; \- and the rest stand for themselves
]]
TEXT_MACROS = re.compile(r"^[.'](SH|SS|TP|IP|B|I|BR|RB|IR|RI|BI|IB|SM|SB|Nm|Nd|Sh|Ss|It|Fl|Ar)\b\s*(.*)$")


def strip_troff(source: str) -> str:
    """Man page source -> its words: macro lines that carry text keep the text, other requests go."""
    lines = []
    for line in source.splitlines():
        if line.startswith((".", "'")):
            match = TEXT_MACROS.match(line)
            if not match:
                continue
            line = match.group(2).replace('"', "")
        for pattern, replacement in ESCAPES:
            line = pattern.sub(replacement, line)
        lines.append(line)
    return "\n".join(lines).strip() + "\n"


def read(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


def documents():
    """(name, text) of every page and document, in sorted path order."""
    for section in MAN_SECTIONS:
        for path in sorted(section.glob("*")):
            if (path.is_file() and not path.is_symlink() and ".3pm" not in path.name
                    and not any(word in path.name.lower() for word in SKIP)):
                text = strip_troff(read(path))
                if len(text) > 200:  # a .so page only points at another one: nothing is left of it
                    yield path.as_posix(), text
    for path in sorted(DOC_ROOT.rglob("*")):
        if (path.is_file() and not path.is_symlink() and DOC_NAMES.search(path.name)
                and not any(word in path.as_posix().lower() for word in SKIP)):
            yield path.as_posix(), read(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the .jsonl file to write")
    out = Path(parser.parse_args().out)
    count = size = 0
    with out.open("w", encoding="utf-8") as f:
        for name, text in documents():
            f.write(json.dumps({"name": name, "text": text}) + "\n")
            count, size = count + 1, size + len(text.encode())
    print(f"wrote {out}: {count} documents, {size / 1e6:.1f} MB of text")


if __name__ == "__main__":
    main()
