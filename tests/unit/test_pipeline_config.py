"""Config validation: mistakes are errors naming the file, the key and what is allowed."""

import pytest

from forge import config
from forge.errors import ForgeError


def write(tmp_path, text):
    p = tmp_path / "upstream.yaml"
    p.write_text(text)
    return p


GOOD = """name: vllm
version: "0.18.1"
sdist: {project: vllm, filename: vllm-0.18.1.tar.gz, sha256: %s, tree_sha256: %s}
git: {tag: v0.18.1, commit: a26e8dc7f}
""" % ("a" * 64, "b" * 64)


def test_real_configs_load():
    up = config.upstream()
    assert up["sdist"]["sha256"] == "8d18eff1c4ed21eb8cf7a45a1d1b34752d5ec287e79186e451d5c2f797cacdb7"
    b = config.build()
    assert b["rocm_arch"] == ["gfx936"] and b["base_image_digest"] in (None,) or b["base_image_digest"].startswith("sha256:")


def test_good_and_defaults(tmp_path):
    d = config.load(write(tmp_path, GOOD), config.UPSTREAM_SCHEMA)
    assert d["git"]["url"] is None and d["sdist"]["sha256"] == "a" * 64


@pytest.mark.parametrize("text,needles", [
    (GOOD.replace("name: vllm", "name: vllm\nextra: 1", 1), ["unknown key 'extra'", "allowed keys"]),
    (GOOD.replace("commit: a26e8dc7f", "commit: a26e8dc7f, branch: x"), ["unknown key 'git.branch'"]),
    (GOOD.replace("a" * 64, "A" * 64), ["'sdist.sha256'", "hex"]),
    (GOOD.replace("name: vllm", "name: sglang", 1), ["'name'", "allowed values: vllm"]),
    (GOOD.replace('version: "0.18.1"', "version: [1]"), ["'version'", "expected string"]),
    (GOOD.replace("git: {tag: v0.18.1, commit: a26e8dc7f}", ""), ["missing key 'git'"]),
    ("name: [unclosed", ["not valid YAML"]),
])
def test_mistakes_name_file_and_key(tmp_path, text, needles):
    with pytest.raises(ForgeError) as e:
        config.load(write(tmp_path, text), config.UPSTREAM_SCHEMA)
    msg = str(e.value)
    assert "upstream.yaml" in msg
    for n in needles:
        assert n in msg


def test_build_digest_format(tmp_path):
    import yaml

    from forge.paths import CONFIGS
    d = yaml.safe_load((CONFIGS / "build.yaml").read_text())
    d["base_image_digest"] = "sha256:xyz"
    p = tmp_path / "build.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(ForgeError, match="base_image_digest"):
        config.load(p, config.BUILD_SCHEMA)
