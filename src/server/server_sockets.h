// The server's socket plumbing beside cpp-httplib: binding, and ending idle connections at stop.
#pragma once

#include <functional>
#include <string>

namespace dflash::server {

// SO_REUSEADDR on a listening socket, so that a restarted server binds while its old connections
// wait out TIME_WAIT. Not cpp-httplib's default SO_REUSEPORT: with it a second server on the same
// port starts too, and the kernel spreads connections over both.
void reuse_address(int sock);

// The error for an address that cannot be bound.
std::string bind_error(const std::string& host, int port);

// Throws Error naming host:port when a server could not bind it now (port 0: any port, nothing to
// check). `dflash serve` asks before it loads the model, which may take minutes.
void check_can_bind(const std::string& host, int port);

// A connection's client as cpp-httplib's Request names it (remote_addr, remote_port).
std::string peer_name(const std::string& addr, int port);

// Once the server stops: ends the reading side of every connection accepted on `port` whose client
// `busy` does not name. A thread that waits for a kept-alive connection's next request
// (cpp-httplib: up to the keep-alive timeout, 75 s) then sees the end and closes it. Connections
// with a request in flight are left alone: cpp-httplib takes a connection whose reading side has
// ended for a client that went away, and would cut the response short. cpp-httplib does not list
// its connections, so they are the process's sockets whose local port is `port` and that have a
// peer.
void end_idle_connections(int port, const std::function<bool(const std::string&)>& busy);

}  // namespace dflash::server
