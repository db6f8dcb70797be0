#include "engine/secret.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/hmac.h"
#include "engine/params.h"

namespace mooncake::engine {

namespace {

std::string errnoText(int e) { return std::strerror(e); }

std::string dirOf(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

Status writeAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t w = ::write(fd, s.data() + off, s.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return MC_STATUS(kIo, "write: " << errnoText(errno));
    off += static_cast<size_t>(w);
  }
  return Status::OK();
}

// Creates `path` with a fresh secret unless it exists: the secret is written to a private
// temporary file that is then hard-linked into place, so a reader never sees a partial file and
// of two creators one wins (link fails with EEXIST for the other, which then reads the winner's).
Status createSecretFile(const std::string& path) {
  std::string dir = dirOf(path);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return MC_STATUS(kIo, "cannot create directory " << dir << ": " << errnoText(errno));
  std::string tmp = path + ".tmp." + std::to_string(getpid()) + "." + generateSecret().substr(0, 8);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return MC_STATUS(kIo, "cannot create " << tmp << ": " << errnoText(errno));
  Status st = writeAll(fd, generateSecret() + "\n");
  if (st.ok() && ::fsync(fd) != 0) st = MC_STATUS(kIo, "fsync " << tmp << ": " << errnoText(errno));
  ::close(fd);
  if (st.ok() && ::link(tmp.c_str(), path.c_str()) != 0 && errno != EEXIST)
    st = MC_STATUS(kIo, "cannot create " << path << ": " << errnoText(errno));
  ::unlink(tmp.c_str());
  return st;
}

}  // namespace

std::string generateSecret() {
  const std::string raw = randomBytes(32);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(64);
  for (char ch : raw) {
    const auto b = static_cast<unsigned char>(ch);
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

std::string defaultSecretFilePath() {
  std::string home = params::getSystem("HOME");
  if (home.empty()) {
    passwd pw{};
    passwd* res = nullptr;
    char buf[4096];
    if (getpwuid_r(geteuid(), &pw, buf, sizeof(buf), &res) == 0 && res != nullptr &&
        res->pw_dir != nullptr)
      home = res->pw_dir;
  }
  if (home.empty()) home = "/tmp";
  return home + "/.mooncake/secret";
}

Result<std::string> loadSecretFile(const std::string& path, bool create) {
  if (path.empty()) return MC_STATUS(kInvalidArgument, "empty secret file path");
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0 && errno == ENOENT && create) {
    MC_RETURN_IF_ERROR(createSecretFile(path));
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  }
  if (fd < 0) {
    int e = errno;
    std::string msg = "cannot read the job secret file " + path + ": " + errnoText(e);
    if (e == ENOENT)
      return Status(Code::kNotFound, msg + " (start mooncake_master once on this host to create "
                                           "it, or set MC_SECRET / MC_SECRET_FILE)");
    return Status(Code::kPermissionDenied, msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return MC_STATUS(kIo, "stat " << path << ": " << errnoText(e));
  }
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    ::close(fd);
    return MC_STATUS(kPermissionDenied,
                     "job secret file " << path << " must be a regular file owned by uid "
                                        << geteuid() << " with mode 0600 (it is mode 0"
                                        << std::oct << (st.st_mode & 0777) << std::dec
                                        << ", uid " << st.st_uid << ")");
  }
  std::string text(kMaxSecretBytes + 2, '\0');
  ssize_t n;
  do {
    n = ::read(fd, text.data(), text.size());
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n < 0) return MC_STATUS(kIo, "read " << path << ": " << errnoText(errno));
  text.resize(static_cast<size_t>(n));
  text = text.substr(0, text.find('\n'));
  while (!text.empty() && (text.back() == '\r' || text.back() == ' ')) text.pop_back();
  if (text.empty()) return MC_STATUS(kInvalidArgument, "job secret file " << path << " is empty");
  if (text.size() > kMaxSecretBytes)
    return MC_STATUS(kInvalidArgument, "job secret in " << path << " is longer than "
                                                        << kMaxSecretBytes << " bytes");
  return text;
}

Result<std::string> resolveSecret(const std::string& given, SecretFile file) {
  if (!given.empty()) return given;
  std::string env = params::getString("MC_SECRET");
  if (!env.empty()) return env;
  std::string path = params::getString("MC_SECRET_FILE");
  if (path.empty()) {
    if (file == SecretFile::kIfSet) return std::string();
    path = defaultSecretFilePath();
  }
  return loadSecretFile(path, file == SecretFile::kDefaultCreate);
}

Status checkSecret(const std::string& secret, const std::string& who) {
  if (secret.size() > kMaxSecretBytes)
    return MC_STATUS(kInvalidArgument,
                     who << ": the job secret is longer than " << kMaxSecretBytes << " bytes");
  if (!secret.empty() && secret.size() < kMinSecretBytes)
    return MC_STATUS(kInvalidArgument,
                     who << ": the job secret has " << secret.size() << " bytes; at least "
                         << kMinSecretBytes
                         << " are needed (e.g. `openssl rand -hex 32`): a handshake shows its "
                            "HMAC, from which a short secret can be guessed offline");
  if (!secret.empty() || params::getBool("MC_ALLOW_NO_SECRET")) return Status::OK();
  return MC_STATUS(kPermissionDenied,
                   who << ": no job secret. Every peer must present one: pass it in, set "
                          "MC_SECRET or MC_SECRET_FILE (the store master creates "
                       << defaultSecretFilePath()
                       << "), or set MC_ALLOW_NO_SECRET=1 to run open to anyone who reaches "
                          "the port");
}

bool secretsEqual(std::string_view a, std::string_view b) {
  size_t n = std::max(a.size(), b.size());
  size_t diff = a.size() ^ b.size();
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<size_t>(x ^ y);
  }
  // Keep the compiler from turning the loop into an early exit.
  volatile size_t sink = diff;
  return sink == 0;
}

}  // namespace mooncake::engine
