#include "server/server_sockets.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <system_error>

#include "util/error.h"

namespace dflash::server {

void reuse_address(int sock) {
  const int yes = 1;
  ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
}

std::string bind_error(const std::string& host, int port) {
  return cat("cannot bind to ", host, ":", port, " (in use, or not an address of this machine)");
}

void check_can_bind(const std::string& host, int port) {
  if (port == 0) return;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  check(::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) == 0 && found,
        bind_error(host, port));
  bool bound = false;
  for (addrinfo* a = found; a && !bound; a = a->ai_next) {
    const int sock = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (sock < 0) continue;
    reuse_address(sock);
    bound = ::bind(sock, a->ai_addr, a->ai_addrlen) == 0;
    ::close(sock);
  }
  ::freeaddrinfo(found);
  check(bound, bind_error(host, port));
}

std::string peer_name(const std::string& addr, int port) { return cat(addr, " ", port); }

void end_idle_connections(int port, const std::function<bool(const std::string&)>& busy) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd = -1;
    try {
      fd = std::stoi(entry.path().filename().string());
    } catch (const std::exception&) {
      continue;
    }
    sockaddr_storage local{}, peer{};
    socklen_t local_len = sizeof local, peer_len = sizeof peer;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0)
      continue;
    const int local_port = local.ss_family == AF_INET    ? ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port)
                           : local.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port)
                                                         : -1;
    if (local_port != port) continue;
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (::getnameinfo(reinterpret_cast<sockaddr*>(&peer), peer_len, host, sizeof host, serv, sizeof serv,
                      NI_NUMERICHOST | NI_NUMERICSERV) != 0)
      continue;
    if (!busy(peer_name(host, std::atoi(serv)))) ::shutdown(fd, SHUT_RD);
  }
}

}  // namespace dflash::server
