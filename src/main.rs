//! `kda-pool`: the KDA state pool's command-line tool.

fn main() {
    println!("kda-pool");
}
