"""bench.peers.carry_sets: what the peer benchmark carries, packed into sets of a size limit (files cut where a set
fills up) and, on the other side, each kind installed once all its parts have come, whatever the order of calls."""

import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path


def _wheel(folder: Path, name: str, payload: bytes) -> Path:
    """A minimal installable wheel whose module ``name`` holds ``payload`` (so it cannot compress much)."""
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": b"DATA = %r\n" % payload,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{k},,\n" for k in list(files) + [f"{dist}/RECORD"]).encode()
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "bench.peers.carry_sets", *map(str, args)], cwd=cwd, check=True,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(Path.cwd()))).stdout


def test_sets_fit_the_limit_and_each_kind_installs_once_complete(tmp_path):
    src = tmp_path / "src"
    for d in ("p1/deps", "p2", "p3", "w1", "w2"):
        (src / d).mkdir(parents=True)
    rnd = os.urandom
    _wheel(src / "p1/deps", "depmod", rnd(3000).hex().encode())
    _wheel(src / "p3", "servermod", rnd(500).hex().encode())
    buf = io.BytesIO()  # the vLLM tree as tar.xz, given in two pieces as the bundle has it
    with tarfile.open(fileobj=buf, mode="w:xz") as t:
        info = tarfile.TarInfo("vllm/__init__.py")
        body = b"X = %r\n" % rnd(4000)
        info.size = len(body)
        t.addfile(info, io.BytesIO(body))
    xz = buf.getvalue()
    (src / "p1/vllm.tar.xz.part-aa").write_bytes(xz[:3000])
    (src / "p2/vllm.tar.xz.part-ab").write_bytes(xz[3000:])
    ray = _wheel(src / "w1", "raymod", rnd(6000).hex().encode())  # cut in two like fetch_wheels.sh does
    data = ray.read_bytes()
    ray.unlink()
    (src / "w1" / (ray.name + ".part-00")).write_bytes(data[:5000])
    (src / "w2" / (ray.name + ".part-01")).write_bytes(data[5000:])
    _wheel(src / "w2", "depmod", b"")  # the same name in two kinds: must be the same file
    (src / "w2" / "depmod-1.0-py3-none-any.whl").write_bytes((src / "p1/deps/depmod-1.0-py3-none-any.whl").read_bytes())
    limit = 4096
    _run("--out", tmp_path / "carry", "--limit-mib", limit / 2 ** 20, "--vllm", src / "p1", src / "p2",
         "--deps", src / "p1/deps", "--server", src / "p3", "--ray", src / "w1", src / "w2", cwd=Path.cwd())
    sets = sorted((tmp_path / "carry").iterdir())
    assert len(sets) > 3
    for s in sets:  # each set within the limit (its MANIFEST aside)
        assert sum(f.stat().st_size for f in s.iterdir() if f.name != "MANIFEST") <= limit
    sites = {k: tmp_path / k for k in ("site", "p3site", "raysite")}
    there = tmp_path / "there"
    (there / "carry").mkdir(parents=True)
    outs = []
    for s in reversed(sets):  # any order: each call carries one set
        os.rename(s, there / "carry" / s.name)
        outs.append(_run("--unpack", there / "carry", "--into", there / "tmp", "--site", sites["site"],
                         "--server-site", sites["p3site"], "--ray-site", sites["raysite"], cwd=Path.cwd()))
        for d in (there / "carry").iterdir():  # the next call carries only its own set
            os.rename(d, tmp_path / f"done-{d.name}")
    assert "installed now" not in outs[0] and "ray installed" in outs[-1]
    assert (sites["site"] / "vllm" / "__init__.py").is_file() and (sites["site"] / "depmod").is_dir()
    assert (sites["p3site"] / "servermod").is_dir()
    assert (sites["raysite"] / "raymod").is_dir() and (sites["raysite"] / "depmod").is_dir()  # shared wheel: both
    got = (sites["raysite"] / "raymod" / "__init__.py").read_bytes()
    assert got == zipfile.ZipFile(io.BytesIO(data)).read("raymod/__init__.py")  # rejoined byte for byte
