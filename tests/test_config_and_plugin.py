"""Config validation and the plugin's version check, without starting an engine."""

from __future__ import annotations

import pytest

from vllm_ainfer_pd.config import AInferPDConfig, ConfigError
from vllm_ainfer_pd.plugin import UnsupportedVLLMVersion, check_vllm_version


def test_supported_version_accepts_local_build_tags():
    check_vllm_version("0.26.0")
    check_vllm_version("0.26.0+cpu")


@pytest.mark.parametrize("found", ["0.25.1", "0.26.1", "0.32.0+cpu"])
def test_unsupported_version_names_found_and_supported(found):
    with pytest.raises(UnsupportedVLLMVersion) as err:
        check_vllm_version(found)
    assert f"vLLM {found} is installed" in str(err.value)
    assert "supports vLLM 0.26.0" in str(err.value)


def test_config_defaults_to_pd_mode():
    assert AInferPDConfig.from_dict(None).mode == "pd"
    assert AInferPDConfig.from_dict({"mode": "normal"}).mode == "normal"


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match=r"unknown ainfer_pd option\(s\) 'segment_spam'"):
        AInferPDConfig.from_dict({"segment_spam": 2})


def test_bad_mode_value_is_named():
    with pytest.raises(ConfigError, match=r"ainfer_pd.mode='fast' is not one of pd, normal"):
        AInferPDConfig.from_dict({"mode": "fast"})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"ainfer_pd.mode=3 must be of type str"):
        AInferPDConfig.from_dict({"mode": 3})
