// The CUDA backend's RegionDevice (server/backend/region_device.h): system
// regions page-locked for the copy engines, CUDA IPC handles opened on the
// server's device (a peer's memory copied over NVLink or PCIe).
#pragma once

#include <memory>

#include "server/backend/region_device.h"

namespace attnserve {

// For the CUDA device `device` (the server's).
std::unique_ptr<RegionDevice> MakeCudaRegionDevice(int device);

}  // namespace attnserve
