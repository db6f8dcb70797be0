// How the store's etcd client proves who it is to etcd and checks whom it talks to
// (etcd_client.h): etcd's user/password authentication and TLS (https endpoints, a CA to verify
// etcd's certificate, an optional client certificate for etcd's --client-cert-auth).
//
// Settings come from the parameter registry (MC_ETCD_USER, MC_ETCD_PASSWORD_FILE,
// MC_ETCD_CA_FILE, MC_ETCD_CERT_FILE, MC_ETCD_KEY_FILE: docs/env.md), which both mooncake_master
// and store clients read; mooncake_master's --etcd-* flags override them. The password is read
// from a file (owned by this user, mode 0600, as the job secret's file), never from the
// environment.
#pragma once

#include <string>

#include "engine/status.h"

namespace mooncake::store::ha {

// What an operator configures: names and paths.
struct EtcdSettings {
  std::string user;           // empty: no authentication
  std::string password_file;  // required with user
  std::string ca_file;        // empty: the system's default CAs
  std::string cert_file;      // client certificate (PEM), with key_file
  std::string key_file;

  // The MC_ETCD_* parameters.
  static EtcdSettings fromParams();
};

// What the client uses: the password read, every file checked.
struct EtcdSecurity {
  std::string user;
  std::string password;
  std::string ca_file;
  std::string cert_file;
  std::string key_file;

  // Any TLS setting given: endpoints written without a scheme use https (as etcd's clientv3
  // does when it has a TLS configuration).
  bool tlsConfigured() const { return !ca_file.empty() || !cert_file.empty(); }

  // Checks and loads `s`: a user needs a password file (and the reverse), a certificate needs
  // its key (and the reverse), every file must be readable; the password file must be a
  // regular file of this user with mode 0600. kInvalidArgument / kPermissionDenied / kNotFound
  // naming the setting and the file.
  static Result<EtcdSecurity> load(const EtcdSettings& s);
  // load(EtcdSettings::fromParams()).
  static Result<EtcdSecurity> fromParams();
};

}  // namespace mooncake::store::ha
