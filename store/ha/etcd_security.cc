#include "store/ha/etcd_security.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "engine/params.h"

namespace mooncake::store::ha {

namespace {

constexpr size_t kMaxPasswordBytes = 4096;

Status readable(const char* setting, const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    return Status(e == ENOENT ? Code::kNotFound : Code::kPermissionDenied,
                  std::string("etcd: ") + setting + " " + path + ": " + std::strerror(e));
  }
  struct stat st {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  ::close(fd);
  if (!regular)
    return MC_STATUS(kInvalidArgument, "etcd: " << setting << " " << path
                                                << " is not a regular file");
  return Status::OK();
}

Result<std::string> readPassword(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    const int e = errno;
    return Status(e == ENOENT ? Code::kNotFound : Code::kPermissionDenied,
                  "etcd: password file " + path + ": " + std::strerror(e));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 077) != 0) {
    ::close(fd);
    return MC_STATUS(kPermissionDenied, "etcd: password file "
                                            << path << " must be a regular file owned by uid "
                                            << geteuid() << " with mode 0600 (it is mode 0"
                                            << std::oct << (st.st_mode & 0777) << std::dec
                                            << ", uid " << st.st_uid << ")");
  }
  std::string text(kMaxPasswordBytes + 2, '\0');
  ssize_t n;
  do {
    n = ::read(fd, text.data(), text.size());
  } while (n < 0 && errno == EINTR);
  const int e = errno;
  ::close(fd);
  if (n < 0) return MC_STATUS(kIo, "etcd: read " << path << ": " << std::strerror(e));
  text.resize(static_cast<size_t>(n));
  // The password is the file's first line, as written by `echo pw > file` (spaces are kept:
  // etcd passwords may hold them).
  text = text.substr(0, text.find('\n'));
  if (!text.empty() && text.back() == '\r') text.pop_back();
  if (text.empty())
    return MC_STATUS(kInvalidArgument, "etcd: password file " << path << " is empty");
  if (text.size() > kMaxPasswordBytes)
    return MC_STATUS(kInvalidArgument, "etcd: password in " << path << " is longer than "
                                                            << kMaxPasswordBytes << " bytes");
  return text;
}

}  // namespace

EtcdSettings EtcdSettings::fromParams() {
  EtcdSettings s;
  s.user = params::getString("MC_ETCD_USER");
  s.password_file = params::getString("MC_ETCD_PASSWORD_FILE");
  s.ca_file = params::getString("MC_ETCD_CA_FILE");
  s.cert_file = params::getString("MC_ETCD_CERT_FILE");
  s.key_file = params::getString("MC_ETCD_KEY_FILE");
  return s;
}

Result<EtcdSecurity> EtcdSecurity::load(const EtcdSettings& s) {
  if (s.user.empty() != s.password_file.empty())
    return MC_STATUS(kInvalidArgument,
                     "etcd: a user (MC_ETCD_USER, --etcd-user) needs a password file "
                     "(MC_ETCD_PASSWORD_FILE, --etcd-password-file) and the reverse; got user '"
                         << s.user << "', password file '" << s.password_file << "'");
  if (s.cert_file.empty() != s.key_file.empty())
    return MC_STATUS(kInvalidArgument,
                     "etcd: a client certificate (MC_ETCD_CERT_FILE, --etcd-cert-file) needs its "
                     "key (MC_ETCD_KEY_FILE, --etcd-key-file) and the reverse; got certificate '"
                         << s.cert_file << "', key '" << s.key_file << "'");
  EtcdSecurity out;
  out.user = s.user;
  if (!s.password_file.empty()) {
    MC_ASSIGN_OR_RETURN(out.password, readPassword(s.password_file));
  }
  if (!s.ca_file.empty()) MC_RETURN_IF_ERROR(readable("CA file", s.ca_file));
  if (!s.cert_file.empty()) MC_RETURN_IF_ERROR(readable("client certificate", s.cert_file));
  if (!s.key_file.empty()) MC_RETURN_IF_ERROR(readable("client key", s.key_file));
  out.ca_file = s.ca_file;
  out.cert_file = s.cert_file;
  out.key_file = s.key_file;
  return out;
}

Result<EtcdSecurity> EtcdSecurity::fromParams() { return load(EtcdSettings::fromParams()); }

}  // namespace mooncake::store::ha
