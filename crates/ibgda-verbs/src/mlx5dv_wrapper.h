/* Input to bindgen (see build.rs): the mlx5 direct-verbs and DEVX API of rdma-core. */
#include <infiniband/verbs.h>
#include <infiniband/mlx5dv.h>
