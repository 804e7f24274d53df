"""`ricordo cache`: look at and tidy a disk KV cache directory (docs/kv-format.md).

Subcommands ls, inspect, verify, rm, prune, stats; `--json` on each for scripts. The
directory comes from the server's own `--kv-disk-dir` / RICORDO_KV_DISK_DIR. Safe while
the server runs: everything is read-only except rm and prune, which only ever unlink exact
`<sha1>.kv` entry names (never temp files) and treat a file that vanished as already gone.
Errors print one `error: ...` line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import struct
import sys
from datetime import datetime

import xxhash

from common import kvfile
from common.config import Settings
from common.policy import lru_victims

PAYLOAD_FIELDS = ("magic", "version", "ctx_size", "chunk_size", "kv_capacity", "sliding_window",
                  "compressed_capacity", "n_tokens", "n_layers", "kv_heads", "head_dim",
                  "vocab_size", "kv_dtype")
KV_DTYPE_NAMES = {kvfile.KV_F32: "f32", kvfile.KV_BF16: "bf16", kvfile.KV_F16: "f16"}


class CacheError(Exception):
    """Reported as one `error: ...` line, exit code 2."""


# ---------------------------------------------------------------- helpers

def iso(t) -> str:
    return "-" if t is None else datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def preview(text: bytes, width: int = 60) -> str:
    """The first `width` characters of text, non-printables escaped (newline as \\n)."""
    out = []
    for ch in text[:width * 4].decode("utf-8", "replace"):
        if ch.isprintable():
            out.append(ch)
        else:
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch) or
                       (f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}"))
    s = "".join(out)
    return s[:width] + "..." if len(s) > width or len(text) > width * 4 else s


def table(headers, rows) -> list[str]:
    """Aligned columns; numbers (int) right-aligned, the last column left ragged."""
    cols = list(zip(headers, *rows))
    widths = [max(len(str(c)) for c in col) for col in cols]
    right = [any(isinstance(c, int) for c in col[1:]) for col in cols]
    lines = []
    for r in [headers, *rows]:
        cells = [str(c).rjust(w) if rt else str(c).ljust(w) for c, w, rt in zip(r, widths, right)]
        cells[-1] = str(r[-1])
        lines.append("  ".join(cells).rstrip())
    return lines


class Cache:
    def __init__(self, path: str):
        if not path:
            raise CacheError("no cache directory: give --kv-disk-dir DIR or set RICORDO_KV_DISK_DIR")
        if not os.path.isdir(path):
            raise CacheError(f"cache directory {path} does not exist or is not a directory")
        self.dir = path

    def names(self) -> list[str]:
        try:
            return sorted(n[:-3] for n in os.listdir(self.dir) if kvfile.is_entry_name(n))
        except OSError as e:
            raise CacheError(f"cannot list {self.dir}: {e.strerror}") from None

    def path(self, sha1: str) -> str:
        return kvfile.entry_path(self.dir, sha1)

    def resolve(self, arg: str) -> str:
        """A full sha1 or a unique prefix of >= 6 hex digits (a trailing .kv is allowed)."""
        p = arg.strip().lower().removesuffix(kvfile.SUFFIX)
        if len(p) < 6 or len(p) > 40 or any(c not in "0123456789abcdef" for c in p):
            raise CacheError(f"{arg!r} is not a sha1 or a prefix of at least 6 hex digits")
        hits = [n for n in self.names() if n.startswith(p)]
        if not hits:
            raise CacheError(f"no entry {arg} in {self.dir}")
        if len(hits) > 1:
            raise CacheError(f"prefix {arg} is ambiguous: {', '.join(h[:12] for h in hits[:5])}...")
        return hits[0]

    def row(self, sha1: str) -> dict | None:
        """The ls fields of one entry (header and text only); `error` set for an unsound one;
        None for an entry gone meanwhile."""
        r = dict(sha1=sha1, tokens=None, reason=None, hits=None, created=None, last_used=None,
                 size=None, preview=None, error=None)
        try:
            meta = kvfile.read_meta(self.path(sha1))
            h = meta.header
            r.update(tokens=h.n_tokens, reason=kvfile.REASON_NAMES.get(h.reason, str(h.reason)),
                     hits=h.hits, created=h.created, last_used=h.last_used, size=meta.size,
                     preview=preview(kvfile.read_text(self.path(sha1))))
            if meta.sha1 != sha1:
                r["error"] = f"name mismatch: text is {meta.sha1}"
        except FileNotFoundError:
            return None
        except (kvfile.KVFileError, OSError) as e:
            r["error"] = str(e)
            try:
                r["size"] = os.path.getsize(self.path(sha1))
            except OSError:
                return None
        return r

    def rows(self) -> list[dict]:
        rows = [r for r in map(self.row, self.names()) if r is not None]
        rows.sort(key=lambda r: (r["last_used"] is not None, r["last_used"] or 0, r["created"] or 0,
                                 r["sha1"]), reverse=True)
        return rows

    def remove(self, sha1: str) -> bool:
        """Unlink exactly `<sha1>.kv`; False when it was already gone."""
        assert kvfile.is_entry_name(sha1 + kvfile.SUFFIX)
        try:
            os.unlink(self.path(sha1))
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            raise CacheError(f"cannot remove {sha1}.kv: {e.strerror}") from None


# ---------------------------------------------------------------- subcommands

def cmd_ls(c: Cache, a, out):
    rows = c.rows()
    if a.json:
        return [{k: v for k, v in r.items() if k != "error" or v} for r in rows], 0
    n = 12
    while len({r["sha1"][:n] for r in rows}) < len(rows):
        n += 1
    body = [(r["sha1"][:n], r["tokens"] if r["tokens"] is not None else "-", r["reason"] or "-",
             r["hits"] if r["hits"] is not None else "-", iso(r["created"]), iso(r["last_used"]),
             human(r["size"]),
             f"ERROR {r['error']}" if r["error"] else r["preview"]) for r in rows]
    lines = table(("SHA1", "TOKENS", "REASON", "HITS", "CREATED", "LAST USED", "SIZE", "TEXT"), body)
    total = sum(r["size"] for r in rows)
    bad = sum(1 for r in rows if r["error"])
    lines.append(f"{len(rows)} entries, {total} bytes ({human(total)})" + (f", {bad} unsound" if bad else ""))
    print("\n".join(lines), file=out)
    return None, 0


def cmd_inspect(c: Cache, a, out):
    sha1 = c.resolve(a.sha1)
    path = c.path(sha1)
    doc: dict = {"sha1": sha1, "path": path}
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if size else memoryview(b"")
    except OSError as e:
        raise CacheError(f"cannot read {path}: {e.strerror}") from None
    doc["size"] = size
    if size >= kvfile.HEADER_SIZE:
        h = kvfile.Header.unpack(buf)
        doc["header"] = dict(magic=h.magic.decode("latin-1"), version=h.version, quant_bits=h.quant_bits,
                             reason=h.reason, reason_name=kvfile.REASON_NAMES.get(h.reason, "?"),
                             flags=h.flags, n_tokens=h.n_tokens, hits=h.hits, ctx_size=h.ctx_size,
                             created=h.created, created_iso=iso(h.created), last_used=h.last_used,
                             last_used_iso=iso(h.last_used), payload_bytes=h.payload_bytes)
    try:
        e = kvfile.read(buf, full=False)
    except kvfile.KVFileError as x:
        doc["error"] = str(x)
        return _show_inspect(doc, a, out)
    p0 = kvfile.TEXT_OFFSET + len(e.text)
    end = p0 + e.header.payload_bytes
    head = struct.unpack_from(kvfile.PAYLOAD_HEAD_FMT, buf, p0)
    doc["payload"] = dict(zip(PAYLOAD_FIELDS, (head[0].decode("latin-1"), *head[1:])))
    doc["payload"]["kv_dtype_name"] = KV_DTYPE_NAMES.get(e.geometry.kv_dtype, "?")
    if head[1] == kvfile.PAYLOAD_V2:   # the per-layer row table after the 13 fields
        doc["layer_rows"] = list(e.rows)
    computed = xxhash.xxh3_64_intdigest(buf[p0:end - kvfile.CHECKSUM_SIZE])
    doc.update(fingerprint=e.fingerprint.hex(), checksum=f"{e.checksum:016x}",
               checksum_ok=computed == e.checksum, text_sha1=e.sha1, name_ok=e.sha1 == sha1,
               text_bytes=len(e.text))
    doc["ktm"] = [dict(id=k, block_bytes=len(v), block_preview=preview(v)) for k, v in e.ktm.items()]
    text = e.text if a.max_text is None else e.text[:a.max_text]
    doc["text"] = text.decode("utf-8", "replace")
    doc["text_truncated"] = len(text) < len(e.text)
    return _show_inspect(doc, a, out)


def _show_inspect(doc, a, out):
    rc = 1 if doc.get("error") or doc.get("checksum_ok") is False or doc.get("name_ok") is False else 0
    if a.json:
        return doc, rc
    p = lambda *s: print(*s, file=out)  # noqa: E731
    p(f"entry      {doc['sha1']}\npath       {doc['path']}\nsize       {doc['size']} bytes")
    if "header" in doc:
        h = doc["header"]
        p("header:")
        for k, v in h.items():
            if k.endswith("_iso") or k == "reason_name":
                continue
            extra = {"reason": h["reason_name"], "created": h["created_iso"],
                     "last_used": h["last_used_iso"],
                     "flags": "KTM" if h["flags"] & kvfile.FLAG_KTM else ""}.get(k, "")
            p(f"  {k:<20} {v}" + (f"  ({extra})" if extra else ""))
    if doc.get("error"):
        p(f"error: {doc['error']}")
        return None, rc
    p("payload header:")
    for i, (k, v) in enumerate(doc["payload"].items()):
        if k != "kv_dtype_name":
            p(f"  {i:>2} {k:<20} {v}" + (f"  ({doc['payload']['kv_dtype_name']})" if k == "kv_dtype" else ""))
    if "layer_rows" in doc:
        p(f"layer rows   {' '.join(map(str, doc['layer_rows']))}")
    p(f"fingerprint  {doc['fingerprint']}")
    p(f"checksum     {doc['checksum']}  ({'ok' if doc['checksum_ok'] else 'MISMATCH'})")
    p(f"text sha1    {doc['text_sha1']}  ({'matches name' if doc['name_ok'] else 'NAME MISMATCH'})")
    p(f"KTM          {len(doc['ktm'])} entries")
    for k in doc["ktm"]:
        p(f"  {k['id']}  {k['block_bytes']} bytes  {k['block_preview']}")
    p(f"text ({doc['text_bytes']} bytes{', truncated' if doc['text_truncated'] else ''}):")
    p("".join(ch if ch.isprintable() or ch in "\n\t" else preview(ch.encode()) for ch in doc["text"]))
    return None, rc


def cmd_verify(c: Cache, a, out):
    names = [c.resolve(s) for s in a.sha1] if a.sha1 else c.names()
    results = []
    for sha1 in names:
        problems = kvfile.verify(c.path(sha1))
        if problems and not os.path.exists(c.path(sha1)):
            continue                           # evicted meanwhile
        results.append({"sha1": sha1, "ok": not problems, "problems": problems})
    bad = [r["sha1"] for r in results if not r["ok"]]
    if a.json:
        return {"checked": len(results), "bad": bad, "results": results}, 1 if bad else 0
    for r in results:
        print(f"OK   {r['sha1']}" if r["ok"] else f"BAD  {r['sha1']}: {'; '.join(r['problems'])}", file=out)
    print(f"{len(results)} checked, {len(bad)} bad" + (": " + " ".join(b + kvfile.SUFFIX for b in bad) if bad else ""),
          file=out)
    return None, 1 if bad else 0


def cmd_rm(c: Cache, a, out):
    targets = list(dict.fromkeys(c.resolve(s) for s in a.sha1))    # all resolve, or nothing goes
    done = [{"sha1": s, "removed": c.remove(s)} for s in targets]
    if a.json:
        return done, 0
    for d in done:
        print(f"removed {d['sha1']}" if d["removed"] else f"gone    {d['sha1']} (already removed)", file=out)
    return None, 0


def cmd_prune(c: Cache, a, out):
    mb = a.max_mb if a.max_mb is not None else a.kv_disk_space_mb
    if mb < 0:
        raise CacheError("--max-mb must be >= 0")
    budget = int(mb * 1024 * 1024)
    allrows = c.rows()
    rows = [r for r in allrows if not r["error"]]              # the persister's valid entries
    victims = lru_victims([(r["sha1"], r["size"], r["last_used"], r["created"]) for r in rows], budget)
    by = {r["sha1"]: r for r in rows}
    removed = [dict(sha1=s, size=by[s]["size"], last_used=by[s]["last_used"],
                    removed=False if a.dry_run else c.remove(s)) for s in victims]
    total = sum(r["size"] for r in rows)
    after = total - sum(by[s]["size"] for s in victims)
    doc = dict(budget_bytes=budget, before_bytes=total, after_bytes=after, dry_run=a.dry_run,
               victims=removed, unsound_skipped=len(allrows) - len(rows))
    if a.json:
        return doc, 0
    verb = "would remove" if a.dry_run else "removed"
    for v in removed:
        print(f"{verb} {v['sha1']}  {human(v['size'])}  last used {iso(v['last_used'])}", file=out)
    print(f"{verb} {len(removed)} entries; {human(total)} -> {human(after)} "
          f"(budget {human(budget)})" + (f"; {doc['unsound_skipped']} unsound entries not counted"
                                          " (see verify, rm)" if doc["unsound_skipped"] else ""), file=out)
    return None, 0


def _num(x):
    return int(x) if float(x).is_integer() else x


def cmd_stats(c: Cache, a, out):
    rows = c.rows()
    good = [r for r in rows if not r["error"]]
    total = sum(r["size"] for r in rows)
    budget = a.kv_disk_space_mb * 1024 * 1024
    reasons: dict[str, int] = {}
    for r in good:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    toks = sorted(r["tokens"] for r in good)
    created = [r["created"] for r in good]
    doc = dict(dir=c.dir, entries=len(rows), unsound=len(rows) - len(good), total_bytes=total,
               budget_bytes=budget, use_pct=round(100 * total / budget, 1) if budget else None,
               by_reason=reasons, total_hits=sum(r["hits"] for r in good),
               oldest=min(created, default=None), newest=max(created, default=None),
               tokens_min=toks[0] if toks else None, tokens_median=_num(statistics.median(toks)) if toks else None,
               tokens_max=toks[-1] if toks else None)
    if a.json:
        return doc, 0
    use = f"{doc['use_pct']}%" if doc["use_pct"] is not None else "-"
    lines = [("directory", c.dir), ("entries", f"{len(rows)}" + (f" ({doc['unsound']} unsound)" if doc["unsound"] else "")),
             ("total", f"{total} bytes ({human(total)})"),
             ("budget", f"{budget} bytes ({human(budget)}), {use} used"),
             ("by reason", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "-"),
             ("total hits", doc["total_hits"]), ("oldest", iso(doc["oldest"])), ("newest", iso(doc["newest"])),
             ("tokens", f"min {doc['tokens_min']}, median {doc['tokens_median']}, max {doc['tokens_max']}"
              if toks else "-")]
    for k, v in lines:
        print(f"{k + ':':<12} {v}", file=out)
    return None, 0


# ---------------------------------------------------------------- entry point

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ricordo cache", description=__doc__.split("\n")[0])
    Settings.add_arguments(ap, "cache")
    js = argparse.ArgumentParser(add_help=False)
    js.add_argument("--json", action="store_true", help="a JSON document on stdout")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{ls,inspect,verify,rm,prune,stats}")
    sub.add_parser("ls", parents=[js], help="one row per entry, most recently used first")
    p = sub.add_parser("inspect", parents=[js], help="every field of one entry")
    p.add_argument("sha1", help="sha1 or unique prefix (>= 6 hex digits)")
    p.add_argument("--max-text", type=int, metavar="N", help="show at most N bytes of the text")
    p = sub.add_parser("verify", parents=[js], help="check every file completely")
    p.add_argument("sha1", nargs="*", help="only these entries (default: all)")
    p = sub.add_parser("rm", parents=[js], help="remove entries")
    p.add_argument("sha1", nargs="+", help="sha1s or unique prefixes")
    p = sub.add_parser("prune", parents=[js], help="LRU-evict down to a budget, like the persister")
    p.add_argument("--max-mb", type=float, help="budget in MiB (default --kv-disk-space-mb)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    sub.add_parser("stats", parents=[js], help="totals, budget use, reasons, hits, token counts")
    return ap


COMMANDS = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "rm": cmd_rm,
            "prune": cmd_prune, "stats": cmd_stats}


def main(argv=None, out=None) -> int:
    out = out or sys.stdout
    try:
        ap = parser()
        a, extra = ap.parse_known_args(argv)
        if extra:       # global flags given after the subcommand: parse them into the same namespace
            glob = argparse.ArgumentParser(prog="ricordo cache", add_help=False)
            Settings.add_arguments(glob, "cache")
            glob.parse_args(extra, namespace=a)
        doc, rc = COMMANDS[a.cmd](Cache(a.kv_disk_dir), a, out)
        if doc is not None:
            json.dump(doc, out, indent=2)
            out.write("\n")
        out.flush()
        return rc
    except CacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:             # argparse (usage already printed) or a bad RICORDO_* value
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        return e.code or 0
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
