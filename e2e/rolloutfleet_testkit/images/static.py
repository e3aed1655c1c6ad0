"""Images of single static programs (the pod sandbox's pause program, CoreDNS, busybox): one layer
holding the binary, built from the file itself and cached by its content."""

from __future__ import annotations

import shutil
from pathlib import Path

from .cache import images_cache
from .oci import sha256_file, tar_layer, write_image_archive


def static_image(
    binary: Path,
    name: str,
    entrypoint: list[str],
    links: tuple[str, ...] = (),
    more_names: tuple[str, ...] = (),
) -> Path:
    """An archive with `binary` at `entrypoint[0]`, named `name` (and `more_names`); `links` are
    more names for it in its directory (busybox's applets)."""
    key = sha256_file(binary)[:16] if not more_names else f"{sha256_file(binary)[:12]}-{len(more_names)}"
    out = images_cache() / "static" / f"{name.replace('/', '_').replace(':', '_')}-{key}.tar"
    if out.exists():
        return out
    work = out.with_suffix(".work")
    shutil.rmtree(work, ignore_errors=True)
    rootfs = work / "rootfs"
    program = rootfs / entrypoint[0].lstrip("/")
    program.parent.mkdir(parents=True)
    shutil.copy2(binary, program)
    program.chmod(0o755)
    for link in links:
        target = program.parent / link
        if not target.exists():
            target.symlink_to(program.name)
    (rootfs / "tmp").mkdir(mode=0o1777)
    (rootfs / "etc").mkdir()
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    layer = tar_layer(rootfs, work / "layer.tar")
    write_image_archive(out, [layer], {"Entrypoint": entrypoint, "Env": ["PATH=/bin"]}, [name, *more_names])
    shutil.rmtree(work)
    return out
