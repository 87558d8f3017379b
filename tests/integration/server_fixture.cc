// The one instantiation of each server fixture (server_fixture.h): page
// sizes 1 and 16.
#include "tests/integration/server_fixture.h"

namespace attnserve {
namespace server_test {

INSTANTIATE_TEST_SUITE_P(PageSizes, ServerTest, ::testing::Values(1, 16), PageSizeName);
INSTANTIATE_TEST_SUITE_P(PageSizes, AuthServerTest, ::testing::Values(1, 16), PageSizeName);

}  // namespace server_test
}  // namespace attnserve
