import pytest

from kvstore.config import KVStoreConfig, load_config, parse_assignments, parse_size
from kvstore.errors import ConfigError


def test_parse_size():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MB") == 512_000_000
    assert parse_size(123) == 123
    with pytest.raises(ConfigError, match="dram.capacity_bytes"):
        parse_size("lots", "dram.capacity_bytes")


def test_defaults_are_valid():
    cfg = KVStoreConfig()
    assert cfg.dram.capacity_bytes > 0 and cfg.ssd.fsync == "batch"


def test_layering_file_env_overrides(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('[dram]\ncapacity_bytes = "1GiB"\n[ssd]\nfsync = "always"\n'
                    '[server]\ntenant_tokens = { acme = "s3cret" }\n')
    cfg = load_config(path, environ={"KVSTORE_SSD__FSYNC": "never",
                                     "KVSTORE_DRAM__HIGH_WATERMARK": "0.9"},
                      overrides=parse_assignments(["dram.capacity_bytes=2GiB"]))
    assert cfg.dram.capacity_bytes == 2 << 30
    assert cfg.ssd.fsync == "never"
    assert cfg.dram.high_watermark == 0.9
    assert cfg.server.tenant_tokens == {"acme": "s3cret"}


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"KVSTORE_SSD__FSYNC": "sometimes"}, "ssd.fsync"),
        ({"KVSTORE_DRAM__HIGH_WATERMARK": "2"}, "dram.high_watermark"),
        ({"KVSTORE_DRAM__NOPE": "1"}, "dram.nope"),
        ({"KVSTORE_BOGUS__X": "1"}, "bogus"),
        ({"KVSTORE_SSD__O_DIRECT": "maybe"}, "ssd.o_direct"),
        ({"KVSTORE_SERVER__DATA_PORT": "70000"}, "server.data_port"),
        ({"KVSTORE_SERVER__MAX_DATA_TRANSFERS": "0"}, "server.max_data_transfers"),
        ({"KVSTORE_SERVER__DATA_SOCKET": "perhaps"}, "server.data_socket"),
    ],
)
def test_bad_values_name_the_field(environ, match):
    with pytest.raises(ConfigError, match=match):
        load_config(environ=environ)


def test_bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[dram\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, environ={})


def test_every_registered_tier_kind_names_a_tier_class_that_takes_its_settings():
    """config.TIER_KINDS is the one registry: each kind's implementation imports and is a Tier."""
    import importlib
    import inspect

    from kvstore.config import TIER_KINDS
    from kvstore.tiers.base import Tier

    for kind, registered in TIER_KINDS.items():
        module, _, name = registered.implementation.partition(":")
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Tier), kind
        assert list(inspect.signature(cls).parameters)[:2] == ["config", "name"], kind


def test_metric_labels_name_tenants_only_where_one_tenant_or_the_operator_says_so():
    """The metrics endpoint has no token: with several tenants their names stay off it."""
    from kvstore.config import ServerConfig

    assert ServerConfig().metric_label_values == 32
    assert ServerConfig(tenant_tokens={"a": "x"}).metric_label_values == 32
    assert ServerConfig(tenant_tokens={"a": "x", "b": "y"}).metric_label_values == 0
    two = {"a": "x", "b": "y"}
    assert ServerConfig(tenant_tokens=two, metrics_max_label_values=8).metric_label_values == 8
