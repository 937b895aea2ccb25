"""Registers the plugin's config directory with Hydra when the package is installed."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class RlkitExamplePluginSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="rlkit-example-plugin", path="pkg://rlkit_example_plugin.conf")
