// MasterService::handle(): every method round-trips through store.proto, and malformed input
// (truncated, random, mismatched bodies, unknown methods) gets an error response, never a crash.
#include <gtest/gtest.h>

#include <random>

#include "store/master/master_service.h"
#include "store/proto/store.pb.h"

namespace mooncake::store {
namespace {

namespace pb = ::mooncake::store::proto;
constexpr uint64_t kMiB = 1024 * 1024;

class RpcTest : public ::testing::Test {
 protected:
  // Sends `req` as method `m`; returns the decoded response body as Resp.
  template <typename Resp>
  Resp call(pb::Method m, const google::protobuf::MessageLite& req, uint64_t rpc_id = 7) {
    pb::RequestEnvelope env;
    env.set_rpc_id(rpc_id);
    env.set_method(m);
    env.set_body(req.SerializeAsString());
    pb::ResponseEnvelope out;
    EXPECT_TRUE(out.ParseFromString(master_.handle(env.SerializeAsString())));
    EXPECT_EQ(out.rpc_id(), rpc_id);
    EXPECT_EQ(out.method(), m);
    EXPECT_EQ(out.error_code(), 0);
    Resp resp;
    EXPECT_TRUE(resp.ParseFromString(out.body()));
    return resp;
  }
  // Feeds raw bytes; the answer must always decode as a ResponseEnvelope.
  pb::ResponseEnvelope raw(std::string_view bytes) {
    pb::ResponseEnvelope out;
    std::string answer = master_.handle(bytes);
    EXPECT_TRUE(out.ParseFromString(answer));
    return out;
  }
  MasterService master_;
};

TEST_F(RpcTest, EveryMethodRoundTrips) {
  pb::MountSegmentRequest mount;
  mount.set_client_id("c1");
  mount.set_segment_name("seg1");
  mount.set_base(0x1000000);
  mount.set_size(kMiB);
  auto mounted = call<pb::MountSegmentResponse>(pb::MOUNT_SEGMENT, mount);
  ASSERT_EQ(mounted.error_code(), 0);
  EXPECT_NE(mounted.segment_id(), 0u);

  pb::HeartbeatRequest hb;
  hb.set_client_id("c1");
  auto beat = call<pb::HeartbeatResponse>(pb::HEARTBEAT, hb);
  EXPECT_EQ(beat.error_code(), 0);
  EXPECT_FALSE(beat.need_remount());
  EXPECT_EQ(beat.client_ttl_ms(), 10000u);
  hb.add_segment_names("seg1");  // the client's mounted segments travel with its heartbeat
  EXPECT_FALSE(call<pb::HeartbeatResponse>(pb::HEARTBEAT, hb).need_remount());
  hb.add_segment_names("seg-the-master-does-not-hold");
  EXPECT_TRUE(call<pb::HeartbeatResponse>(pb::HEARTBEAT, hb).need_remount());

  pb::PutStartRequest ps;
  ps.set_client_id("c1");
  ps.set_key(std::string("k\0ey", 4));  // keys are bytes: embedded NUL is fine
  ps.set_size(4096);
  ps.mutable_config()->set_replica_num(1);
  auto started = call<pb::PutStartResponse>(pb::PUT_START, ps);
  ASSERT_EQ(started.error_code(), 0);
  ASSERT_EQ(started.replicas_size(), 1);
  const pb::Piece& piece = started.replicas(0).pieces(0);
  EXPECT_EQ(piece.segment_name(), "seg1");
  EXPECT_EQ(piece.client_id(), "c1");
  EXPECT_EQ(piece.address(), 0x1000000 + piece.offset());
  EXPECT_EQ(piece.length(), 4096u);

  pb::GetReplicaListRequest get;
  get.set_key(ps.key());
  EXPECT_EQ(call<pb::GetReplicaListResponse>(pb::GET_REPLICA_LIST, get).error_code(),
            toInt(ErrorCode::REPLICA_IS_NOT_READY));

  pb::PutEndRequest pe;
  pe.set_client_id("c1");
  pe.set_key(ps.key());
  EXPECT_EQ(call<pb::PutEndResponse>(pb::PUT_END, pe).error_code(), 0);

  auto got = call<pb::GetReplicaListResponse>(pb::GET_REPLICA_LIST, get);
  ASSERT_EQ(got.error_code(), 0);
  EXPECT_EQ(got.size(), 4096u);
  EXPECT_EQ(got.lease_ttl_ms(), 5000u);
  ASSERT_EQ(got.replicas_size(), 1);
  EXPECT_EQ(got.replicas(0).pieces(0).address(), piece.address());

  pb::BatchGetReplicaListRequest bget;
  bget.add_keys(ps.key());
  bget.add_keys("missing");
  auto bgot = call<pb::BatchGetReplicaListResponse>(pb::BATCH_GET_REPLICA_LIST, bget);
  ASSERT_EQ(bgot.results_size(), 2);
  EXPECT_EQ(bgot.results(0).error_code(), 0);
  EXPECT_EQ(bgot.results(1).error_code(), toInt(ErrorCode::OBJECT_NOT_FOUND));

  pb::ExistsRequest ex;
  ex.set_key(ps.key());
  EXPECT_TRUE(call<pb::ExistsResponse>(pb::EXISTS, ex).exists());
  pb::BatchExistsRequest bex;
  bex.add_keys(ps.key());
  bex.add_keys("missing");
  auto bexr = call<pb::BatchExistsResponse>(pb::BATCH_EXISTS, bex);
  ASSERT_EQ(bexr.results_size(), 2);
  EXPECT_TRUE(bexr.results(0).exists());
  EXPECT_FALSE(bexr.results(1).exists());

  pb::GetSizeRequest gs;
  gs.set_key(ps.key());
  EXPECT_EQ(call<pb::GetSizeResponse>(pb::GET_SIZE, gs).size(), 4096u);

  pb::RemoveRequest rm;
  rm.set_key(ps.key());
  EXPECT_EQ(call<pb::RemoveResponse>(pb::REMOVE, rm).error_code(),
            toInt(ErrorCode::OBJECT_HAS_LEASE));
  rm.set_force(true);
  EXPECT_EQ(call<pb::RemoveResponse>(pb::REMOVE, rm).error_code(), 0);

  for (const char* k : {"a1", "a2", "b1"}) {
    ps.set_key(k);
    ASSERT_EQ(call<pb::PutStartResponse>(pb::PUT_START, ps).error_code(), 0);
    pe.set_key(k);
    ASSERT_EQ(call<pb::PutEndResponse>(pb::PUT_END, pe).error_code(), 0);
  }
  pb::RemoveByRegexRequest rr;
  rr.set_regex("^a");
  auto removed = call<pb::RemoveByRegexResponse>(pb::REMOVE_BY_REGEX, rr);
  EXPECT_EQ(removed.error_code(), 0);
  EXPECT_EQ(removed.removed(), 2u);
  rr.set_regex("[");
  EXPECT_EQ(call<pb::RemoveByRegexResponse>(pb::REMOVE_BY_REGEX, rr).error_code(),
            toInt(ErrorCode::INVALID_PARAMS));
  pb::RemoveAllRequest ra;
  EXPECT_EQ(call<pb::RemoveAllResponse>(pb::REMOVE_ALL, ra).removed(), 1u);

  ps.set_key("revoked");
  ASSERT_EQ(call<pb::PutStartResponse>(pb::PUT_START, ps).error_code(), 0);
  pb::PutRevokeRequest rv;
  rv.set_client_id("c1");
  rv.set_key("revoked");
  EXPECT_EQ(call<pb::PutRevokeResponse>(pb::PUT_REVOKE, rv).error_code(), 0);

  // Batched puts (put sessions): each entry answered as its own call; tokens name each put.
  pb::BatchPutStartRequest bps;
  bps.set_client_id("c1");
  for (const char* k : {"b1", "b2", "b1", ""}) {
    pb::PutStartRequest* one = bps.add_puts();
    one->set_client_id("ignored");
    one->set_key(k);
    one->set_size(100);
  }
  auto bstarted = call<pb::BatchPutStartResponse>(pb::BATCH_PUT_START, bps);
  ASSERT_EQ(bstarted.error_code(), 0);
  ASSERT_EQ(bstarted.results_size(), 4);
  EXPECT_EQ(bstarted.results(0).error_code(), 0);
  EXPECT_EQ(bstarted.results(1).error_code(), 0);
  EXPECT_EQ(bstarted.results(2).error_code(), toInt(ErrorCode::OBJECT_ALREADY_EXISTS));
  EXPECT_EQ(bstarted.results(3).error_code(), toInt(ErrorCode::INVALID_KEY));
  EXPECT_EQ(bstarted.results(0).replicas_size(), 1);
  EXPECT_NE(bstarted.results(0).put_token(), bstarted.results(1).put_token());
  EXPECT_GT(bstarted.results(0).release_after_ms(), 0u);
  pb::BatchPutEndRequest bpe;
  bpe.set_client_id("c1");
  bpe.add_puts()->set_key("b1");
  bpe.mutable_puts(0)->set_put_token(bstarted.results(0).put_token());
  bpe.add_puts()->set_key("b2");
  bpe.mutable_puts(1)->set_put_token(bstarted.results(0).put_token());  // b1's: not b2's put
  bpe.add_puts()->set_key("missing");
  auto bended = call<pb::BatchPutEndResponse>(pb::BATCH_PUT_END, bpe);
  ASSERT_EQ(bended.results_size(), 3);
  EXPECT_EQ(bended.results(0).error_code(), 0);
  EXPECT_EQ(bended.results(1).error_code(), toInt(ErrorCode::OBJECT_NOT_FOUND));
  EXPECT_EQ(bended.results(2).error_code(), toInt(ErrorCode::OBJECT_NOT_FOUND));
  EXPECT_TRUE(master_.exists("b1").ok() && *master_.exists("b1"));
  EXPECT_FALSE(*master_.exists("b2")) << "ended with another put's token";
  rv.set_key("b2");
  rv.set_put_token(bstarted.results(1).put_token());
  EXPECT_EQ(call<pb::PutRevokeResponse>(pb::PUT_REVOKE, rv).error_code(), 0);

  // Upserts: a new key, then a replacement (with its id), a revoked one; replica clear.
  pb::UpsertStartRequest us;
  us.set_client_id("c1");
  us.set_key("up");
  us.set_size(100);
  auto u1 = call<pb::UpsertStartResponse>(pb::UPSERT_START, us);
  ASSERT_EQ(u1.error_code(), 0);
  EXPECT_NE(u1.upsert_id(), 0u);
  EXPECT_EQ(u1.replicas_size(), 1);
  pb::UpsertEndRequest ue;
  ue.set_client_id("c1");
  ue.set_key("up");
  ue.set_upsert_id(u1.upsert_id());
  EXPECT_EQ(call<pb::UpsertEndResponse>(pb::UPSERT_END, ue).error_code(), 0);
  us.set_size(300);
  auto u2 = call<pb::UpsertStartResponse>(pb::UPSERT_START, us);
  ASSERT_EQ(u2.error_code(), 0);
  ue.set_upsert_id(u1.upsert_id());  // a stale id
  EXPECT_EQ(call<pb::UpsertEndResponse>(pb::UPSERT_END, ue).error_code(),
            toInt(ErrorCode::INVALID_WRITE));
  ue.set_upsert_id(u2.upsert_id());
  EXPECT_EQ(call<pb::UpsertEndResponse>(pb::UPSERT_END, ue).error_code(), 0);
  EXPECT_EQ(master_.getSize("up").value(), 300u);
  auto u3 = call<pb::UpsertStartResponse>(pb::UPSERT_START, us);
  pb::UpsertRevokeRequest ur;
  ur.set_client_id("c1");
  ur.set_key("up");
  ur.set_upsert_id(u3.upsert_id());
  EXPECT_EQ(call<pb::UpsertRevokeResponse>(pb::UPSERT_REVOKE, ur).error_code(), 0);
  pb::BatchReplicaClearRequest bc;
  bc.set_client_id("c1");
  bc.add_keys("up");
  bc.add_keys("absent");
  auto cleared = call<pb::BatchReplicaClearResponse>(pb::BATCH_REPLICA_CLEAR, bc);
  EXPECT_EQ(cleared.error_code(), 0);
  ASSERT_EQ(cleared.cleared_size(), 1);
  EXPECT_EQ(cleared.cleared(0), "up");
  EXPECT_TRUE(master_.checkInvariants());
  // One round trip per put: a slab, then an object published from it (and the slab retired).
  pb::AllocSlabRequest as;
  as.set_client_id("c1");
  as.set_replica_num(1);
  as.set_bytes(64 << 10);
  auto slab = call<pb::AllocSlabResponse>(pb::ALLOC_SLAB, as);
  ASSERT_EQ(slab.error_code(), 0);
  ASSERT_EQ(slab.slab().extents_size(), 1);
  EXPECT_EQ(slab.slab().bytes(), 64u << 10);
  pb::PublishRequest pub;
  pub.set_client_id("c1");
  pb::PublishEntry* entry = pub.add_entries();
  entry->set_key("slabbed");
  entry->set_size(1000);
  entry->set_slab_id(slab.slab().slab_id());
  entry->set_put_id(7);
  pub.add_retire(slab.slab().slab_id());
  auto published = call<pb::PublishResponse>(pb::PUBLISH, pub);
  ASSERT_EQ(published.results_size(), 1);
  EXPECT_EQ(published.results(0), 0);
  gs.set_key("slabbed");
  EXPECT_EQ(call<pb::GetSizeResponse>(pb::GET_SIZE, gs).size(), 1000u);
  EXPECT_EQ(master_.metrics().slabs, 0u) << "retired with the publish";
  // A report (a client that came back after a rebuild): its segment keeps no records here.
  pb::ReportObjectsRequest rep;
  rep.set_client_id("c1");
  rep.set_segment_name("seg1");
  rep.set_last(true);
  EXPECT_EQ(call<pb::ReportObjectsResponse>(pb::REPORT_OBJECTS, rep).error_code(), 0);
  rep.set_segment_name("nope");
  EXPECT_EQ(call<pb::ReportObjectsResponse>(pb::REPORT_OBJECTS, rep).error_code(),
            toInt(ErrorCode::SEGMENT_NOT_FOUND));

  pb::UnmountSegmentRequest um;
  um.set_client_id("c1");
  um.set_segment_name("seg1");
  EXPECT_EQ(call<pb::UnmountSegmentResponse>(pb::UNMOUNT_SEGMENT, um).error_code(), 0);
  EXPECT_EQ(master_.metrics().segments, 0u);
  EXPECT_TRUE(master_.checkInvariants());

  MasterMetrics m = master_.metrics();
  ASSERT_EQ(m.rpcs.size(), 23u);
  for (const auto& r : m.rpcs) EXPECT_GE(r.calls, 1u) << r.method;
  std::string text = m.toPrometheus();
  EXPECT_NE(text.find("mooncake_store_rpc_calls_total{method=\"PUT_START\"} 5"), std::string::npos)
      << text;
}

TEST_F(RpcTest, MalformedEnvelopesGetInvalidParams) {
  EXPECT_EQ(raw("").error_code(), toInt(ErrorCode::INVALID_PARAMS)) << "no method";
  EXPECT_EQ(raw("\xff\xff\xff").error_code(), toInt(ErrorCode::INVALID_PARAMS));
  pb::RequestEnvelope env;
  env.set_rpc_id(42);
  env.set_method(static_cast<pb::Method>(99));  // a method from the future
  auto out = raw(env.SerializeAsString());
  EXPECT_EQ(out.error_code(), toInt(ErrorCode::INVALID_PARAMS));
  EXPECT_EQ(out.rpc_id(), 42u);
  EXPECT_TRUE(out.body().empty());
  // A body that is not the method's request message.
  env.set_method(pb::PUT_START);
  env.set_body("\x0a\xff\xff\xff\xff\x0f");  // field 1, length far past the end
  EXPECT_EQ(raw(env.SerializeAsString()).error_code(), toInt(ErrorCode::INVALID_PARAMS));
  // An empty body is a valid (all-default) request; the call itself answers.
  env.set_body("");
  out = raw(env.SerializeAsString());
  EXPECT_EQ(out.error_code(), 0);
  pb::PutStartResponse ps;
  ASSERT_TRUE(ps.ParseFromString(out.body()));
  EXPECT_EQ(ps.error_code(), toInt(ErrorCode::INVALID_KEY));
}

// Every prefix of every valid request: each gets a decodable answer, state stays consistent.
TEST_F(RpcTest, TruncatedRequestsNeverCrash) {
  pb::MountSegmentRequest mount;
  mount.set_client_id("c");
  mount.set_segment_name("s");
  mount.set_base(4096);
  mount.set_size(kMiB);
  pb::PutStartRequest ps;
  ps.set_client_id("c");
  ps.set_key("some-key");
  ps.set_size(1000);
  ps.mutable_config()->set_replica_num(2);
  ps.mutable_config()->set_preferred_segment("s");
  pb::BatchGetReplicaListRequest bg;
  for (int i = 0; i < 10; ++i) bg.add_keys("key" + std::to_string(i));
  pb::RemoveByRegexRequest rr;
  rr.set_regex("^key[0-9]+$");
  std::vector<std::pair<pb::Method, std::string>> reqs = {
      {pb::MOUNT_SEGMENT, mount.SerializeAsString()},
      {pb::PUT_START, ps.SerializeAsString()},
      {pb::BATCH_GET_REPLICA_LIST, bg.SerializeAsString()},
      {pb::REMOVE_BY_REGEX, rr.SerializeAsString()},
  };
  for (const auto& [method, body] : reqs) {
    pb::RequestEnvelope env;
    env.set_rpc_id(0x123456789abcull);
    env.set_method(method);
    env.set_body(body);
    std::string full = env.SerializeAsString();
    for (size_t n = 0; n <= full.size(); ++n) raw(std::string_view(full.data(), n));
    // The body alone, truncated, inside a well-formed envelope.
    for (size_t n = 0; n <= body.size(); ++n) {
      env.set_body(body.substr(0, n));
      raw(env.SerializeAsString());
    }
  }
  EXPECT_TRUE(master_.checkInvariants());
}

TEST_F(RpcTest, RandomBytesNeverCrash) {
  std::mt19937_64 rng(20240601);
  // Pure noise, then noise inside a valid envelope for every method.
  for (int i = 0; i < 20000; ++i) {
    std::string bytes(rng() % 64, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    raw(bytes);
  }
  for (int m = 0; m <= 19; ++m) {
    for (int i = 0; i < 2000; ++i) {
      pb::RequestEnvelope env;
      env.set_rpc_id(rng());
      env.set_method(static_cast<pb::Method>(m));
      std::string body(rng() % 48, '\0');
      for (char& c : body) c = static_cast<char>(rng());
      env.set_body(body);
      pb::ResponseEnvelope out = raw(env.SerializeAsString());
      EXPECT_EQ(out.rpc_id(), env.rpc_id());
    }
  }
  EXPECT_TRUE(master_.checkInvariants());
}

// A remote call acts in the name its connection authenticated as: a body naming another client
// is ILLEGAL_CLIENT and changes nothing (the spoofed MOUNT_SEGMENT of the security issue).
TEST_F(RpcTest, CallsInAnotherClientsNameAreRefused) {
  auto as = [&](const std::string& caller, pb::Method method,
                const google::protobuf::MessageLite& req) {
    pb::RequestEnvelope env;
    env.set_rpc_id(1);
    env.set_method(method);
    env.set_body(req.SerializeAsString());
    pb::ResponseEnvelope out;
    EXPECT_TRUE(out.ParseFromString(master_.handle(env.SerializeAsString(), &caller)));
    return out;
  };
  auto code = [](const pb::ResponseEnvelope& env, auto* resp) {
    EXPECT_TRUE(resp->ParseFromString(env.body()));
    return resp->error_code();
  };
  pb::MountSegmentRequest mount;
  mount.set_client_id("victim");
  mount.set_segment_name("victim-seg");
  mount.set_base(0x10000);
  mount.set_size(kMiB);
  pb::MountSegmentResponse mr;
  EXPECT_EQ(code(as("attacker", pb::MOUNT_SEGMENT, mount), &mr),
            static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT));
  EXPECT_TRUE(master_.segments().empty()) << "the spoofed mount took effect";
  EXPECT_EQ(code(as("victim", pb::MOUNT_SEGMENT, mount), &mr), 0) << "its own mount works";

  pb::UnmountSegmentRequest um;
  um.set_client_id("victim");
  um.set_segment_name("victim-seg");
  pb::UnmountSegmentResponse ur;
  EXPECT_EQ(code(as("attacker", pb::UNMOUNT_SEGMENT, um), &ur),
            static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT));
  pb::PutStartRequest ps;
  ps.set_client_id("victim");
  ps.set_key("k");
  ps.set_size(100);
  pb::PutStartResponse psr;
  EXPECT_EQ(code(as("attacker", pb::PUT_START, ps), &psr),
            static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT));
  EXPECT_EQ(code(as("victim", pb::PUT_START, ps), &psr), 0);
  pb::PutEndRequest pe;
  pe.set_client_id("victim");
  pe.set_key("k");
  pb::PutEndResponse per;
  EXPECT_EQ(code(as("attacker", pb::PUT_END, pe), &per),
            static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT));
  pb::PutRevokeRequest pr;
  pr.set_client_id("victim");
  pr.set_key("k");
  pb::PutRevokeResponse prr;
  EXPECT_EQ(code(as("attacker", pb::PUT_REVOKE, pr), &prr),
            static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT));
  pb::BatchPutStartRequest bps;
  bps.set_client_id("victim");
  bps.add_puts()->set_key("k2");
  bps.mutable_puts(0)->set_size(100);
  pb::BatchPutStartResponse bpsr;
  EXPECT_EQ(code(as("attacker", pb::BATCH_PUT_START, bps), &bpsr),
            static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT));
  EXPECT_EQ(bpsr.results_size(), 0);
  pb::BatchPutEndRequest bpe;
  bpe.set_client_id("victim");
  bpe.add_puts()->set_key("k");
  pb::BatchPutEndResponse bper;
  EXPECT_EQ(code(as("attacker", pb::BATCH_PUT_END, bpe), &bper),
            static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT));
  pb::HeartbeatRequest hb;
  hb.set_client_id("victim");
  pb::HeartbeatResponse hr;
  EXPECT_EQ(code(as("attacker", pb::HEARTBEAT, hb), &hr),
            static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT));
  // No client id at all is a malformed call, as docs/store_errors.md says, not an impersonation.
  pb::HeartbeatRequest anon;
  EXPECT_EQ(code(as("attacker", pb::HEARTBEAT, anon), &hr),
            static_cast<int32_t>(ErrorCode::INVALID_PARAMS));
  pb::MountSegmentRequest anon_mount;
  anon_mount.set_segment_name("s");
  anon_mount.set_base(0x1000000);
  anon_mount.set_size(kMiB);
  pb::MountSegmentResponse amr;
  EXPECT_EQ(code(as("attacker", pb::MOUNT_SEGMENT, anon_mount), &amr),
            static_cast<int32_t>(ErrorCode::INVALID_PARAMS));
  EXPECT_EQ(code(as("victim", pb::PUT_END, pe), &per), 0);
  ASSERT_EQ(master_.segments().size(), 1u);
  EXPECT_TRUE(master_.exists("k").ok() && *master_.exists("k"));
  EXPECT_TRUE(master_.checkInvariants());
}

}  // namespace
}  // namespace mooncake::store
