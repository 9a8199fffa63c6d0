// Communicator over Gloo (CPU tensors, TCP transport). Ranks meet through files in a directory
// they all see (Debian's Gloo has file, hash and Redis stores but no TCP store), so the shards
// of one group run on one machine, which is what the CPU backend needs.
//
// Rendezvous: rank 0 owns the directory while it lives (an flock on <dir>/lock; a second group
// on the same directory fails at once instead of mixing with this one). Holding the lock, it
// deletes whatever an earlier group left behind and publishes a fresh session id in
// <dir>/session; the ranks exchange their TCP addresses under <dir>/<session>/. A rank that read
// a stale session id (it started before rank 0 cleaned up) notices the id change and retries.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/communicator.h"

namespace tgis::server {

struct GlooOptions {
  int rank = 0;
  int world_size = 1;
  // Shared by every rank of the group, one group per directory.
  std::string rendezvous_dir;
  // Where this rank's TCP device listens: an address or host name, or a network interface
  // (`iface`, e.g. from GLOO_SOCKET_IFNAME), which wins when set.
  std::string hostname = "127.0.0.1";
  std::string iface;
  // Limit for the rendezvous and for each collective.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

// True when this build has Gloo (libgloo-dev); otherwise ConnectGloo fails with kUnimplemented.
bool GlooAvailable();

// Joins the group; returns when every rank has connected (or fails after `timeout`).
absl::StatusOr<std::shared_ptr<Communicator>> ConnectGloo(const GlooOptions& options);

// The rendezvous directory of the shard group at MASTER_ADDR:MASTER_PORT:
// <tmp>/tgis-rendezvous-<addr>-<port>.
std::string DefaultRendezvousDir(const std::string& master_addr, int master_port);

}  // namespace tgis::server
