"""Where SPU is not installed (the plaintext path on a current JAX: scripts/xla_env.sh), the
test files of the secure path are not collected and report as such; everything else runs."""
import importlib.util

# Test files that exercise the secure path (SPU) or the parties.
SPU_TEST_FILES = ("test_wire.py", "test_mpc.py", "test_mpc_accounting.py", "test_mpc_cost.py",
                  "test_distributed.py")
HAS_SPU = importlib.util.find_spec("spu") is not None

collect_ignore = [] if HAS_SPU else list(SPU_TEST_FILES)


def pytest_report_header(config):
    if not HAS_SPU:
        return (f"spu is not installed: the secure path's tests ({', '.join(SPU_TEST_FILES)}) "
                "are not collected")
