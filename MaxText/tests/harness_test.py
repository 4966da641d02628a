"""The test harness itself: which tests unit_test_and_lint.sh's `--dist loadgroup` keeps on one worker."""

import pytest

from MaxText.tests.conftest import uses_own_module_fixture

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def built_once():
  return object()


def test_a_test_that_needs_its_module_s_fixture_shares_the_module_s_worker(request, built_once):
  assert uses_own_module_fixture(request.node)
  assert request.node.get_closest_marker("xdist_group").args == ("MaxText/tests/harness_test.py",)
  if request.config.getoption("loadgroup", default=False):  # under `-n N --dist loadgroup`: xdist read the mark
    assert request.node.nodeid.endswith("@MaxText/tests/harness_test.py"), request.node.nodeid


def test_a_test_with_only_shared_fixtures_goes_to_any_worker(request, tmp_path, corpus):
  assert not uses_own_module_fixture(request.node)  # corpus is module-scoped but conftest's: cheap, not grouped
  assert request.node.get_closest_marker("xdist_group") is None
