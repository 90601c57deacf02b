"""target/schema.py: the one declaration of the management inputs' fields, shared by the service and the API."""

from __future__ import annotations

import uuid

import pytest

from api import schemas
from nvmeof import defaults
from nvmeof.spec.fabrics import PORTID_MAX
from nvmeof.spec.identify import NSID_MAX
from target import config, schema
from target.backends import OPTION_KEYS
from target.service.checks import ServiceError


def _bounds(model: type, name: str) -> tuple[int | None, int | None]:
    low = high = None
    for item in model.model_fields[name].metadata:
        low = getattr(item, "ge", low)
        high = getattr(item, "le", high)
    return low, high


@pytest.mark.parametrize(("model", "name", "field"), [
    (schemas.SubsystemCreate, "max_namespaces", schema.MAX_NAMESPACES),
    (schemas.NamespaceCreate, "nsid", schema.NSID),
    (schemas.NamespaceCreate, "anagrpid", schema.ANAGRPID),
    (schemas.NamespaceAnaGroup, "anagrpid", schema.ANAGRPID),
    (schemas.NamespaceResize, "size", schema.SIZE),
    (schemas.ListenerCreate, "trsvcid", schema.TRSVCID),
    (schemas.ListenerCreate, "portid", schema.LISTENER_PORTID),
    (schemas.ReferralCreate, "trsvcid", schema.TRSVCID),
    (schemas.ReferralCreate, "portid", schema.REFERRAL_PORTID),
    (schemas.NamespaceQosSet, "rw_ios_per_second", schema.QOS_IOS),
    (schemas.NamespaceQosSet, "w_mbytes_per_second", schema.QOS_MBYTES),
])
def test_the_api_bodies_take_the_schema_limits(model: type, name: str, field: schema.IntField) -> None:
    assert _bounds(model, name) == (field.low, field.high)


def test_the_limits_come_from_the_spec_and_defaults() -> None:
    # the referral portid was 0..0xFFFF in the API and 0..0xFFFE in the service (issue 27): now one field
    assert (schema.REFERRAL_PORTID.low, schema.REFERRAL_PORTID.high) == (0, PORTID_MAX)
    assert (schema.LISTENER_PORTID.low, schema.LISTENER_PORTID.high) == (1, PORTID_MAX)
    assert schema.NSID.high == schema.MAX_NAMESPACES.high == NSID_MAX
    assert schema.ANAGRPID.high == defaults.ANAGRPMAX
    assert schemas.SubsystemCreate.model_fields["serial"].metadata[0].max_length == schema.SERIAL_MAX


def test_int_field_check_words_the_refusal() -> None:
    assert schema.NSID.check("7") == 7
    with pytest.raises(schema.SchemaError, match=r"nsid 9 is out of range; use 1\.\.8"):
        schema.NSID.check(9, 8)
    with pytest.raises(schema.SchemaError, match="nsid must be an integer, got True"):
        schema.NSID.check(True)
    with pytest.raises(ServiceError) as err:
        schema.REFERRAL_PORTID.check(PORTID_MAX + 1)  # the service's refusal as it stands: a 400
    assert err.value.status == 400
    assert err.value.message == f"portid {PORTID_MAX + 1} is out of range; use 0..{PORTID_MAX}"


def test_value_checks() -> None:
    eui64 = schema.check_hex_id("00:11:22:33:44:55:66:77", "eui64", schema.EUI64_LEN)
    assert eui64 == bytes.fromhex("0011223344556677")
    with pytest.raises(schema.SchemaError, match="all zeros"):
        schema.check_hex_id("0" * 32, "nguid", schema.NGUID_LEN)
    with pytest.raises(schema.SchemaError, match="is 2 bytes; it must be 8"):
        schema.check_hex_id("abcd", "eui64", schema.EUI64_LEN)
    assert schema.check_uuid(str(uuid.UUID(int=5))) == uuid.UUID(int=5)
    with pytest.raises(schema.SchemaError, match="not a UUID"):
        schema.check_uuid("nope")
    with pytest.raises(schema.SchemaError, match="the limit is 20"):
        schema.check_ascii("x" * 21, "serial", schema.SERIAL_MAX)
    assert schema.check_address("tcp", "[::1]", "4420", None) == ("tcp", "ipv6", "::1", 4420)
    with pytest.raises(ServiceError, match="is ipv4, but the address family given is ipv6"):
        schema.check_address("tcp", "127.0.0.1", 4420, "ipv6")


@pytest.mark.parametrize(("body", "fields", "api_only"), [
    (schemas.SubsystemCreate, schema.SUBSYSTEM_FIELDS, set()),
    (schemas.NamespaceCreate, schema.NAMESPACE_FIELDS, {"create"}),  # an action, not kept
    (schemas.HostAdd, schema.HOST_FIELDS, {"hostnqn"}),  # the config's "nqn"
    (schemas.ListenerCreate, schema.LISTENER_FIELDS, set()),
    (schemas.ReferralCreate, schema.REFERRAL_FIELDS, set()),
])
def test_the_api_bodies_name_the_schema_fields(body: type, fields: dict[str, type], api_only: set[str]) -> None:
    """A REST body's fields are the configuration item's (the backend settings are a namespace's too)."""
    extra = set(body.model_fields) - set(fields) - api_only - set(OPTION_KEYS)
    assert not extra, f"{body.__name__} has fields target/schema.py does not declare: {sorted(extra)}"


def test_the_config_checks_the_schema_fields() -> None:
    assert set(config._fields("listener")) == set(schema.LISTENER_FIELDS)
    assert config._fields("namespace")["nsid"].kind is int and config._fields("host")["tls_key"].kind is str
    with pytest.raises(config.ConfigError, match=r"listeners\[0\]\.trsvcid: expected integer, got str"):
        config.validate_config({"version": 1, "listeners": [{"traddr": "::1", "trsvcid": "4420"}]})


def test_a_host_secret_of_the_wrong_type_is_not_echoed() -> None:
    assert set(schema.HOST_SECRET_FIELDS) <= set(schema.HOST_FIELDS)
    item = {"nqn": "nqn.2024-01.com.example:s", "hosts": [{"nqn": "nqn.2024-01.com.example:h", "tls_key": 12345}]}
    with pytest.raises(config.ConfigError) as err:
        config.validate_config({"version": 1, "subsystems": [item]})
    assert "tls_key: expected string, got int a secret" in str(err.value) and "12345" not in str(err.value)


@pytest.mark.parametrize(("body", "fields"), [
    (schemas.SubsystemCreate, schema.SUBSYSTEM),
    (schemas.NamespaceCreate, schema.NAMESPACE),
    (schemas.HostAdd, schema.HOST),
    (schemas.ListenerCreate, schema.LISTENER),
    (schemas.ReferralCreate, schema.REFERRAL),
    (schemas.NamespaceQosSet, schema.QOS),
])
def test_the_api_bodies_are_built_from_the_schema_fields(body: type, fields: dict[str, schema.Field]) -> None:
    """Each declared body field is the REST body's, with its default, range and description (one place)."""
    for name, field in fields.items():
        key = field.body_name or name
        if not field.in_body:
            assert key not in body.model_fields
            continue
        info = body.model_fields[key]
        if field.default is schema.REQUIRED_IN_BODY:
            assert info.is_required(), name
        else:
            default = info.default_factory() if info.default_factory is not None else info.default
            assert default == field.default, name
        if field.range is not None:
            assert _bounds(body, key) == (field.range.low, field.range.high)
        assert (info.description or "").startswith(field.description or ""), name
        assert (info.description is None) == (field.description is None), name
    assert set(schema.kinds(fields)) == {name for name, field in fields.items() if field.in_file}


def test_a_body_built_from_a_declaration_refuses_what_it_refuses() -> None:
    listener = schemas.ListenerCreate.model_validate({"traddr": "::1"})
    assert (listener.trsvcid, listener.tls, listener.adrfam) == (defaults.TCP_IO_PORT, "none", None)
    with pytest.raises(ValueError, match="less than or equal to 65535"):
        schemas.ReferralCreate.model_validate({"traddr": "::1", "trsvcid": 65536})
    with pytest.raises(ValueError, match="hostnqn"):
        schemas.HostAdd.model_validate({"nqn": "nqn.2024-01.com.example:h"})  # the file's name, not the body's
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        schemas.NamespaceCreate.model_validate({"backend": "ram", "qos": {}})  # set through PUT .../qos
    ns = schemas.NamespaceCreate.model_validate({"backend": "ram", "uuid": str(uuid.UUID(int=7))})
    assert ns.uuid == uuid.UUID(int=7) and ns.hosts == [] and ns.block_size == defaults.DEFAULT_BLOCK_SIZE


def test_the_qos_fields_are_the_limits_target_qos_keeps() -> None:
    from target import qos

    assert tuple(schema.QOS) == qos.LIMIT_KEYS


@pytest.mark.parametrize(("body", "name"), [
    (schemas.NamespaceResize, "size"),
    (schemas.NamespaceAnaGroup, "anagrpid"),
    (schemas.NamespaceAutoVisible, "auto_visible"),
])
def test_a_one_setting_body_takes_the_namespace_field(body: type, name: str) -> None:
    info, field = body.model_fields[name], schema.NAMESPACE[name]
    assert info.is_required() and info.annotation is field.kind
    if field.range is not None:
        assert _bounds(body, name) == (field.range.low, field.range.high)
    with pytest.raises(ValueError, match="Field required"):
        body.model_validate({})
