// Symbols of rdma-core's libibverbs.so.1 that the emulator does not implement but that other
// libraries loaded into the same process bind to at load time (BIND_NOW): Debian 13's torch
// pulls in libfabric, librdmacm and libefa, which refuse to load against a libibverbs without
// them (an undefined symbol or symbol version). Each one fails when called (EOPNOTSUPP, or a
// null pointer with errno EOPNOTSUPP) and does nothing otherwise; the engine calls none of
// them. Deliberately without <infiniband/verbs.h>: only the names and versions matter to the
// loader, not the prototypes (libibverbs.map assigns the versions).
#include <cerrno>

#define MC_FV_PUBLIC __attribute__((visibility("default")))

extern "C" {

// IBVERBS_1.0
MC_FV_PUBLIC void ibv_copy_path_rec_from_kern() {}
MC_FV_PUBLIC void ibv_copy_qp_attr_from_kern() {}
MC_FV_PUBLIC void* ibv_get_sysfs_path() {
  errno = EOPNOTSUPP;
  return nullptr;
}
MC_FV_PUBLIC int ibv_read_sysfs_file() { return EOPNOTSUPP; }
// IBVERBS_1.1
MC_FV_PUBLIC int ibv_attach_mcast() { return EOPNOTSUPP; }
MC_FV_PUBLIC void ibv_copy_ah_attr_from_kern() {}
MC_FV_PUBLIC void* ibv_create_ah() {
  errno = EOPNOTSUPP;
  return nullptr;
}
MC_FV_PUBLIC void* ibv_create_srq() {
  errno = EOPNOTSUPP;
  return nullptr;
}
MC_FV_PUBLIC int ibv_destroy_ah() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_destroy_srq() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_detach_mcast() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_query_pkey() { return EOPNOTSUPP; }
// IBVERBS_1.10
MC_FV_PUBLIC int ibv_query_ece() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_set_ece() { return EOPNOTSUPP; }
// IBVERBS_1.13
// IBV_FORK_UNNEEDED: the emulator pins nothing, a forked child cannot corrupt its transfers.
MC_FV_PUBLIC int ibv_is_fork_initialized() { return 2; }
// IBVERBS_1.14
MC_FV_PUBLIC int ibv_query_qp_data_in_order() { return EOPNOTSUPP; }
// IBVERBS_1.5
MC_FV_PUBLIC int ibv_get_pkey_index() { return EOPNOTSUPP; }
// IBVERBS_1.6
MC_FV_PUBLIC void* ibv_qp_to_qp_ex() {
  errno = EOPNOTSUPP;
  return nullptr;
}
// IBVERBS_1.9
MC_FV_PUBLIC int ibv_get_device_index() { return EOPNOTSUPP; }
// IBVERBS_PRIVATE_34
MC_FV_PUBLIC void __verbs_log() {}
MC_FV_PUBLIC void* _verbs_init_and_alloc_context() {
  errno = EOPNOTSUPP;
  return nullptr;
}
MC_FV_PUBLIC int execute_ioctl() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_alloc_pd() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_create_ah() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_create_cq_ex() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_create_qp_ex() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_dealloc_pd() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_dereg_mr() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_destroy_ah() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_destroy_cq() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_destroy_qp() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_get_context() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_modify_qp() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_query_device_any() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_query_port() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_query_qp() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_reg_dmabuf_mr() { return EOPNOTSUPP; }
MC_FV_PUBLIC int ibv_cmd_reg_mr() { return EOPNOTSUPP; }
MC_FV_PUBLIC void verbs_register_driver_34() {}
MC_FV_PUBLIC void verbs_set_ops() {}
MC_FV_PUBLIC void verbs_uninit_context() {}

}  // extern "C"
