"""project.apt's pure pieces (runner/toolchain/apt.py): the package-name check, the parse
of apt's ``--print-uris`` and ``apt-cache show`` output (captured from apt 2.6 on Debian
12 against the analyst image's status), and the private sources."""

from __future__ import annotations

import pytest

from runner.errors import ConfigError
from runner.toolchain.apt import (
    check_apt_names,
    debs_of,
    parse_print_uris,
    parse_show,
    sources_list,
)

# apt-get install --print-uris -qq nodejs (two of its ten lines): apt prints the MD5 for a
# main-archive .deb and nothing at all for a security one
PRINT_URIS = (
    "'http://deb.debian.org/debian/pool/main/c/c-ares/libc-ares2_1.18.1-3_amd64.deb' "
    "libc-ares2_1.18.1-3_amd64.deb 102484 MD5Sum:a56844c6332cb330f8920e62ea41fac9\n"
    "'http://deb.debian.org/debian-security/pool/updates/main/n/nodejs/"
    "nodejs_18.20.4%2bdfsg-1%7edeb12u3_amd64.deb' nodejs_18.20.4+dfsg-1~deb12u3_amd64.deb "
    "322140 \n"
)
SHOW = """Package: nodejs
Version: 18.20.4+dfsg-1~deb12u3
Description: evented I/O for V8 javascript - runtime executable
Filename: pool/updates/main/n/nodejs/nodejs_18.20.4+dfsg-1~deb12u3_amd64.deb
Size: 322140
SHA256: 97d0944c0da81b0acd4c6d58e7d5a2894f89aa66067400a86c9ecb0b76969ecc
Description-md5: 1b4f3e0e0b8a4e0d0c1b5d0f4d2f3b8a
 a continuation line: ignored

Package: libc-ares2
Version: 1.18.1-3
Filename: pool/main/c/c-ares/libc-ares2_1.18.1-3_amd64.deb
Size: 102484
MD5sum: a56844c6332cb330f8920e62ea41fac9
SHA256: 087fd5c2ac883202e1786ab45617cdab7f77bc7f060d58cca177ddf6b6c3fa73
"""


def test_print_uris_and_show_give_each_deb_with_its_sha256() -> None:
    debs = debs_of(PRINT_URIS, SHOW)
    assert [(d.pin, d.arch, d.filename, d.size) for d in debs] == [
        ("libc-ares2=1.18.1-3", "amd64", "libc-ares2_1.18.1-3_amd64.deb", 102484),
        ("nodejs=18.20.4+dfsg-1~deb12u3", "amd64", "nodejs_18.20.4+dfsg-1~deb12u3_amd64.deb",
         322140)]
    assert debs[1].sha256.startswith("97d0944c0da8")
    assert debs[1].url.startswith("http://deb.debian.org/debian-security/")


def test_a_deb_the_lists_give_no_sha256_for_is_refused() -> None:
    show = SHOW.replace("SHA256: 087fd5c2ac883202e1786ab45617cdab7f77bc7f060d58cca177ddf6b6c3fa73",
                        "")
    with pytest.raises(ConfigError, match=r"no SHA256 for libc-ares2=1\.18\.1-3"):
        debs_of(PRINT_URIS, show)


def test_other_lines_are_not_debs() -> None:
    assert parse_print_uris("Reading package lists...\nW: something\n") == []
    assert parse_show("Package: x\nVersion: 1\nSHA256: nothex\n") == {}


@pytest.mark.parametrize("name", ["nodejs", "npm", "libstdc++6", "python3.11",
                                  "nodejs=18.20.4+dfsg-1~deb12u3", "g++=4:12.2.0-3"])
def test_plain_debian_names_pass(name: str) -> None:
    assert check_apt_names((name,), path="cycle.yaml") == (name,)


@pytest.mark.parametrize("name", ["-oAPT::Get::AllowUnauthenticated=1", "--allow-downgrades",
                                  "./evil.deb", "/tmp/x.deb", "http://x/y.deb", "NodeJS",
                                  "nodejs;id", "a b", "", "nodejs=", "x\x1b[2J"])
def test_options_paths_and_urls_are_not_package_names(name: str) -> None:
    with pytest.raises(ConfigError, match=r"cycle\.yaml: project\.apt: .* is not a Debian "
                                          r"package name"):
        check_apt_names((name,), path="cycle.yaml")


def test_names_are_sorted_and_duplicates_refused() -> None:
    assert check_apt_names(("npm", "nodejs"), path="c") == ("nodejs", "npm")
    with pytest.raises(ConfigError, match="listed twice"):
        check_apt_names(("nodejs", "nodejs"), path="c")


def test_the_private_sources_are_the_base_images_suite_with_its_fixes() -> None:
    assert sources_list("http://m/debian", "http://m/debian-security") == (
        "deb http://m/debian bookworm main\n"
        "deb http://m/debian bookworm-updates main\n"
        "deb http://m/debian-security bookworm-security main\n")
