#!/usr/bin/env python3
"""Write a one-layer OCI image as an image-layout archive that `ctr images import` accepts.

    mkimage.py OUT.tar --name localhost/gpu-fraction/pause:1 --entrypoint /pause \
        --file /path/to/pause:pause
    mkimage.py OUT.tar --name localhost/gpu-fraction/busybox:1 --cmd sh \
        --file /bin/busybox:bin/busybox --link bin/sh:busybox ...

Standard library only; the archive is reproducible (fixed times, owners and order). The image's
name is the index annotation `io.containerd.image.name` (and `org.opencontainers.image.ref.name`).
"""

import argparse
import gzip
import hashlib
import io
import json
import tarfile


def _info(name: str, **kw) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def layer(
    files: list[tuple[str, str, int]], links: list[tuple[str, str]], dirs: list[str]
) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parents = set(dirs)
        for dst, _, _ in files:
            parents.update(_parents(dst))
        for dst, _ in links:
            parents.update(_parents(dst))
        for d in sorted(parents):
            tar.addfile(_info(d, type=tarfile.DIRTYPE, mode=0o755))
        for dst, src, mode in sorted(files):
            with open(src, "rb") as f:
                data = f.read()
            tar.addfile(_info(dst, size=len(data), mode=mode), io.BytesIO(data))
        for dst, target in sorted(links):
            tar.addfile(_info(dst, type=tarfile.SYMTYPE, linkname=target, mode=0o777))
    return raw.getvalue()


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--name", required=True)
    ap.add_argument("--entrypoint", action="append", default=[])
    ap.add_argument("--cmd", action="append", default=[])
    # Docker's default PATH, as the images our examples name carry it (the toolkit's CDI spec
    # mounts nvidia-smi at /usr/bin)
    ap.add_argument(
        "--env",
        action="append",
        default=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    )
    ap.add_argument("--file", action="append", default=[], help="SRC:DST[:OCTAL_MODE]")
    ap.add_argument("--link", action="append", default=[], help="DST:TARGET (a symlink)")
    ap.add_argument("--dir", action="append", default=[], help="an empty directory")
    a = ap.parse_args()

    files = []
    for spec in a.file:
        src, dst, *mode = spec.split(":")
        files.append((dst.lstrip("/"), src, int(mode[0], 8) if mode else 0o755))
    links = [(d.lstrip("/"), t) for d, t in (s.split(":", 1) for s in a.link)]
    tar_bytes = layer(files, links, [d.strip("/") for d in a.dir])
    diff_id = "sha256:" + hashlib.sha256(tar_bytes).hexdigest()
    gz = gzip.compress(tar_bytes, mtime=0)

    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": a.env, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "hack/cluster/images/mkimage.py"}],
    }
    if a.entrypoint:
        config["config"]["Entrypoint"] = a.entrypoint
    if a.cmd:
        config["config"]["Cmd"] = a.cmd
    cfg = blob(json.dumps(config, sort_keys=True).encode())
    lay = blob(gz)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **lay}],
    }
    man = blob(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **man,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": a.name,
                    "org.opencontainers.image.ref.name": a.name.rsplit(":", 1)[-1],
                },
            }
        ],
    }
    with tarfile.open(a.out, "w", format=tarfile.PAX_FORMAT) as out:

        def add(name: str, data: bytes) -> None:
            out.addfile(_info(name, size=len(data), mode=0o644), io.BytesIO(data))

        out.addfile(_info("blobs", type=tarfile.DIRTYPE, mode=0o755))
        out.addfile(_info("blobs/sha256", type=tarfile.DIRTYPE, mode=0o755))
        for digest in sorted(blobs):
            add("blobs/sha256/" + digest.split(":", 1)[1], blobs[digest])
        add("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add("index.json", json.dumps(index, sort_keys=True).encode())


if __name__ == "__main__":
    main()
