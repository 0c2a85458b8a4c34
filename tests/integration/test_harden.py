"""images/harden.sh in a real image build (helper-43 #6): a file capability (the
``security.capability`` xattr, as iputils-ping's postinst sets cap_net_raw=ep) does not
survive the hardening, and the setuid check still holds. Builds FROM the analyst image
with no network, like the derived image does."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest

from runner.paths import images_dir

pytestmark = pytest.mark.docker

# vfs_cap_data v2, effective: cap_net_raw (13) permitted
CAP = "0100000200200000000000000000000000000000"
# Each check fails the build itself (a RUN step's output can be missing from the legacy
# builder's log when the step is short): the xattr was really set, then none is left.
DOCKERFILE = f"""
ARG ANALYST_IMAGE
FROM ${{ANALYST_IMAGE}}
USER 0:0
RUN cp /usr/bin/true /usr/local/bin/capped \\
 && python3 -c "import os, sys; os.setxattr('/usr/local/bin/capped', 'security.capability', \\
bytes.fromhex('{CAP}')); sys.exit(os.getxattr('/usr/local/bin/capped', \\
'security.capability').hex() != '{CAP}')"
COPY harden.sh /tmp/harden.sh
RUN sh /tmp/harden.sh && rm -f /tmp/harden.sh
RUN python3 -c "import os, sys; sys.exit('LEFT' if os.listxattr('/usr/local/bin/capped') else 0)"
"""


# helper-48 #2: the image's PATH puts /opt/venv/bin first, where an agent's wheels put
# console scripts and .pth files: a `find` that does nothing and a .pth that hides every
# capability must not keep a setuid bit or a file capability past the hardening.
SUBVERTED = f"""
ARG ANALYST_IMAGE
FROM ${{ANALYST_IMAGE}}
USER 0:0
RUN cp /usr/bin/true /usr/local/bin/capped && cp /usr/bin/true /usr/local/bin/suid \\
 && chmod 4755 /usr/local/bin/suid \\
 && /usr/bin/python3 -c "import os; os.setxattr('/usr/local/bin/capped', \\
'security.capability', bytes.fromhex('{CAP}'))" \\
 && printf '#!/bin/sh\\nexit 0\\n' > /opt/venv/bin/find && chmod 755 /opt/venv/bin/find \\
 && echo 'import os; os.getxattr = lambda *a, **k: (_ for _ in ()).throw(OSError(61, "x"))' \\
    > "$(/opt/venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz.pth"
COPY harden.sh /tmp/harden.sh
RUN sh /tmp/harden.sh && rm -f /tmp/harden.sh
RUN /usr/bin/python3 -I -S -c "import os, sys; \\
sys.exit('LEFT' if os.listxattr('/usr/local/bin/capped') else 0)" \\
 && test ! -u /usr/local/bin/suid
"""


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, SUBVERTED], ids=["plain", "subverted"])
def test_harden_strips_file_capabilities(tmp_path: Path, dockerfile: str) -> None:
    from runner.isolation.docker.backend import DockerSandbox
    from runner.isolation.docker.images import resolve_image

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    shutil.copy2(images_dir() / "harden.sh", ctx / "harden.sh")
    backend = DockerSandbox()
    tag = f"cyclebox-test/harden:{secrets.token_hex(4)}"
    lines: list[str] = []
    try:
        for line in backend.build(ctx, tag, buildargs={"ANALYST_IMAGE": resolve_image("analyst")},
                                  labels={"test": "harden"}, nocache=True):
            lines.append(line)
        # built: the capability was set (step 4) and is gone (the last step)
        assert backend.image_id(tag) is not None, "\n".join(lines)[-2000:]
    finally:
        if backend.image_id(tag) is not None:
            backend.client.api.remove_image(tag, force=True)
