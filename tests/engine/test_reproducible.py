"""engine/reproducible.py: MKL's reproducible code path is chosen unless the user chose one.

(The property it buys is checked by the bitwise comparisons of tests/engine/test_streaming.py and
tests/engine/test_logits_cli.py: on an AMD EPYC with AVX-512 they failed without it.)"""

import os

from engine.reproducible import MKL_CBWR, pin_cpu_math


def test_pins_the_strict_branch_when_unset():
    env = {"PATH": "/bin"}
    assert pin_cpu_math(env) == MKL_CBWR == "AUTO,STRICT"
    assert env == {"PATH": "/bin", "MKL_CBWR": "AUTO,STRICT"}


def test_keeps_the_users_choice():
    env = {"MKL_CBWR": "COMPATIBLE"}
    assert pin_cpu_math(env) == "COMPATIBLE" and env == {"MKL_CBWR": "COMPATIBLE"}


def test_the_test_session_runs_pinned():
    assert os.environ.get("MKL_CBWR")  # tests/app/conftest.py pins it before the first product
