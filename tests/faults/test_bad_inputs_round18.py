"""Inputs found to be taken wrongly in the eighteenth round of input hardening.

`forge score --run a b --bogus`: refused as "--run takes one value, given 2 words ('a' 'b')", and the option typed
after the split value (--bogus) was never named, where `--run a --bogus` names it. Both are now said.

`forge e2e-gpu --tier-order 16-32K,` (or `,16-32K`, `4-8K,,8-16K`): refused as "no tier named ''", a comma too
many read as a tier named ''. It is now refused as an empty item, naming --tier-order and the value typed, with
the tiers there are, before anything is written, as --profiles of the same verb refuses one.
"""

from __future__ import annotations

import pytest
from helpers import forge
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round17 import e2e_gpu_writes_nothing


def test_an_unknown_option_after_a_split_value_is_named_too(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", "a", "b", "--bogus")
    refused(r, "--run takes one value, given 2 words ('a' 'b')")
    assert "--bogus: not an option of forge score" in r.stderr, r.stderr


@pytest.mark.parametrize("order", ["16-32K,", ",16-32K", "4-8K,,8-16K"])
def test_e2e_gpu_refuses_an_empty_tier_as_an_empty_item(tmp_path, order):
    r = e2e_gpu_writes_nothing(tmp_path, "--tier-order", order)
    refused(r, f"--tier-order {order!r}: an empty item")
    assert "no tier named" not in r.stderr and "4-8K, 8-16K, 16-32K" in fix_line(r), r.stderr
