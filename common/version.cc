#include "common/version.h"

#include "attnserve/version.h"

namespace attnserve {

const char kVersion[] = ATTNSERVE_VERSION;
const char kGitCommit[] = ATTNSERVE_GIT_COMMIT;

}  // namespace attnserve
