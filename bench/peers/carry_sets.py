"""What the peer benchmark carries to the GPU machine, packed into sets that each fit one `device` call.

Here, once (after ../shared/device/peers/make_vllm_bundle.sh .peers and ../shared/device/fetch_wheels.sh .whl
--closure "ray[serve]==2.60.0" httpx, and vLLM's server packages in .peers/p3):

    python3 -m bench.peers.carry_sets --out .peers/carry --limit-mib 50 \\
        --vllm .peers/p1 .peers/p2 --deps .peers/p1/deps --server .peers/p3 --ray .whl/set1 .whl/set2

writes .peers/carry/c1, c2, ... (each at most --limit-mib: 64 MiB less the working tree that travels beside it),
every one with MANIFEST: each logical file, its kind and its parts. Files are cut into parts where a set fills
up (a split file is rejoined in order). Kinds, in the order they are packed (what comes first is usable first):
deps (vLLM's offline packages, pydantic among them, which our engine needs too), vllm (the vLLM tree as
vllm.tar.xz), server (what vLLM's OpenAI server needs beyond those), ray (the Ray Serve closure).

There, in every call that carries a set (bench/peers/device.sh does this first):

    python3 -m bench.peers.carry_sets --unpack .peers/carry

copies what came to /tmp/carry and, for each kind whose parts have all come, installs it once: deps into
/tmp/peers/site, vllm unpacked into /tmp/peers/site, server into /tmp/peers/p3site, ray into /tmp/site.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

KINDS = ("deps", "vllm", "server", "ray")
PART = re.compile(r"^(?P<name>.+)\.part-(?P<i>[0-9a-z]+)$")


def logical_files(folders: list[str], pattern: str = "*") -> list[tuple[str, list[Path]]]:
    """(name, its pieces in order) of the files in ``folders``: NAME.part-XX pieces make one file NAME."""
    groups: dict[str, list[Path]] = {}
    for folder in folders:
        for p in sorted(Path(folder).glob(pattern)):
            if not p.is_file() or p.name in ("MANIFEST", "install_wheels.sh"):
                continue
            m = PART.match(p.name)
            groups.setdefault(m["name"] if m else p.name, []).append(p)
    return [(name, sorted(ps, key=lambda q: q.name)) for name, ps in sorted(groups.items())]


def plan(items: list[tuple[str, str, int]], limit: int) -> list[list[tuple[str, str, int, int, int]]]:
    """Next-fit packing of (kind, name, size) in order into sets of at most ``limit`` bytes, a file cut where a set
    fills up: per set, (kind, name, part index, offset, length)."""
    sets, used, counts = [[]], 0, {}
    for kind, name, size in items:
        off = 0
        while off < size or size == 0:
            if used >= limit:
                sets.append([])
                used = 0
            n = min(size - off, limit - used)
            i = counts.get(name, 0)
            counts[name] = i + 1
            sets[-1].append((kind, name, i, off, n))
            used += n
            off += n
            if size == 0:
                break
    return sets


def pack(args) -> None:
    srcs = {"deps": (args.deps, "*.whl"), "vllm": (args.vllm, "vllm.tar.xz*"), "server": (args.server, "*.whl"),
            "ray": (args.ray, "*")}
    items, pieces, shared = [], {}, []
    for kind in KINDS:
        folders, pattern = srcs[kind]
        for name, ps in logical_files(folders or [], pattern):
            size = sum(p.stat().st_size for p in ps)
            if name in pieces:  # the same wheel in two kinds (pydantic: vLLM's and Ray's): carried once
                if sum(p.stat().st_size for p in pieces[name]) != size:
                    sys.exit(f"{name}: two different files of one name")
                shared.append((kind, name))
                continue
            pieces[name] = ps
            # pydantic first among the deps: the first set then runs our engine
            items.append((kind, name, size, 0 if "pydantic" in name else 1))
    items.sort(key=lambda it: (KINDS.index(it[0]), it[3]))
    sets = plan([(k, n, s) for k, n, s, _ in items], int(args.limit_mib * 2 ** 20))
    nparts = {}
    for s in sets:
        for _, name, *_ in s:
            nparts[name] = nparts.get(name, 0) + 1
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    manifest = "".join(f"{k} {n} {nparts[n]}\n" for k, n in [(k, n) for k, n, *_ in items] + shared)
    for j, s in enumerate(sets, 1):
        d = out / f"c{j}"
        d.mkdir(parents=True)
        (d / "MANIFEST").write_text(manifest)
        for kind, name, i, off, n in s:
            target = d / (name if nparts[name] == 1 else f"{name}.part-{i:02d}")
            with target.open("wb") as w:
                copy_range(pieces[name], off, n, w)
        print(f"{d}: {sum(f.stat().st_size for f in d.iterdir()) / 2 ** 20:.1f} MiB, "
              f"{', '.join(sorted({k for k, *_ in s}))}")


def copy_range(pieces: list[Path], off: int, n: int, w) -> None:
    """Bytes [off, off + n) of the concatenation of ``pieces`` into ``w``."""
    for p in pieces:
        size = p.stat().st_size
        if off >= size:
            off -= size
            continue
        with p.open("rb") as r:
            r.seek(off)
            take = min(n, size - off)
            while take:
                chunk = r.read(min(take, 1 << 22))
                w.write(chunk)
                take -= len(chunk)
                n -= len(chunk)
        off = 0
        if not n:
            return


def unpack(args) -> None:
    carried, into = Path(args.unpack), Path(args.into)
    into.mkdir(parents=True, exist_ok=True)
    for f in sorted(carried.glob("c*/*")):
        if f.is_file() and not (into / f.name).exists():
            shutil.copyfile(f, into / f.name)
    if not (into / "MANIFEST").exists():
        print("carry_sets: nothing carried yet")
        return
    entries = [line.split() for line in (into / "MANIFEST").read_text().splitlines() if line.strip()]
    sites = {"deps": args.site, "vllm": args.site, "server": args.server_site, "ray": args.ray_site}
    state = {}
    for kind in KINDS:
        mine = [(name, int(n)) for k, name, n in entries if k == kind]
        done = Path(sites[kind]) / f".carried-{kind}"
        if done.exists():
            state[kind] = "installed"
            continue
        # a file is here whole (carried whole, or rejoined in an earlier call) or as all of its parts
        parts = {name: [] if (into / name).exists() else [into / name] if n == 1 else
                 [into / f"{name}.part-{i:02d}" for i in range(n)] for name, n in mine}
        missing = sum(not p.exists() for ps in parts.values() for p in ps)
        if not mine or missing:
            state[kind] = f"{missing} parts to come" if mine else "none"
            continue
        files = []
        for name, ps in parts.items():
            if len(ps) > 1:  # rejoin a split file (whole before its parts go)
                tmp = into / (name + ".joining")
                with tmp.open("wb") as w:
                    for q in ps:
                        w.write(q.read_bytes())
                tmp.rename(into / name)
                for q in ps:
                    q.unlink()
            files.append(into / name)
        Path(sites[kind]).mkdir(parents=True, exist_ok=True)
        if kind == "vllm":
            with tarfile.open(files[0], "r:xz") as t:
                t.extractall(sites[kind], filter="fully_trusted")
        else:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", sites[kind], *map(str, files)], check=True)
        done.touch()
        state[kind] = "installed now"
    print("carry_sets: " + ", ".join(f"{k} {v}" for k, v in state.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="pack into OUT/c1, c2, ...")
    ap.add_argument("--limit-mib", type=float, default=50.0)
    ap.add_argument("--deps", nargs="*")
    ap.add_argument("--vllm", nargs="*", help="folders holding vllm.tar.xz or its parts")
    ap.add_argument("--server", nargs="*")
    ap.add_argument("--ray", nargs="*")
    ap.add_argument("--unpack", help="there: the carried folder (its c* sets)")
    ap.add_argument("--into", default="/tmp/carry")
    ap.add_argument("--site", default="/tmp/peers/site")
    ap.add_argument("--server-site", default="/tmp/peers/p3site")
    ap.add_argument("--ray-site", default="/tmp/site")
    args = ap.parse_args()
    if args.unpack:
        unpack(args)
    elif args.out:
        pack(args)
    else:
        ap.error("--out (pack, here) or --unpack (there)")


if __name__ == "__main__":
    main()
