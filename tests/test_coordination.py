"""JAX's private key-value store, which coordination.py reaches into: still where jdp looks for it."""

from jdp.job.coordination import missing_key_value_api, step_value


def test_jax_private_key_value_store_is_still_where_jdp_reaches_for_it():
    import jax

    missing = missing_key_value_api()
    assert not missing, (
        f"jax {jax.__version__} moved or changed its private key-value store ({missing}). The stop agreement and "
        f"the step watchdog use it: adapt jdp.job.coordination.KeyValueStore (the only place that touches it) or cap "
        f"jax in pyproject.toml below this version"
    )


def test_step_values_read_back_are_checked(capsys):
    assert step_value("jdp/a", "12") == 12
    for bad in ("-3", "1e9", "nan", "12 ", "", "٣", "9" * 30):
        assert step_value(f"jdp/{bad}", bad) is None
    assert "ignoring jdp/-3='-3'" in capsys.readouterr().err
