"""A platform plugin: activates when ``MOE_DBO_TEST_PLATFORM=1`` (a plugin that returns None stays
inactive, so installing it changes nothing by itself)."""

import os


def register() -> str | None:
    if os.environ.get("MOE_DBO_TEST_PLATFORM") != "1":
        return None
    return "moe_dbo_test_platform.platform.PluginPlatform"
